// The dashboards against a real Prometheus and a real run: starts three
// interlock-worker processes and Debian's prometheus on loopback ports (with
// dashboards/prometheus/prometheus.yml and its rule files, only the target
// files and intervals adapted), trains tests/deploy/metrics_run.pbtxt through
// the workers, and asserts through the HTTP API that every PromQL expression
// of every Grafana panel, every template variable and every recording rule
// returns data at some point of the run. The expressions are read from the
// dashboard JSON and the rule files, never listed here.
//
// Also checks the workers' gRPC health as probes see it: NOT_SERVING (and
// 'liveness' SERVING) before the run, SERVING once configured; and that the
// metric tables of docs/ARCHITECTURE.md match what the processes export
// (names, types, labels), from their own /metrics and from Prometheus.
//
//   node tests/deploy/prometheus_test.mjs REPO_ROOT INTERLOCK_CLI INTERLOCK_WORKER
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import YAML from "yaml";

const [ROOT, CLI, WORKER] = process.argv.slice(2).map((p) => path.resolve(p));
const PROMETHEUS = process.env.PROMETHEUS ?? "prometheus";
const RUN = "ci-metrics";
const BLOCKS = 3;
const DEADLINE_MS = 80_000;

// Metrics whose names are agreed but which this build does not export yet
// (none at present). An expression that needs one of these is reported as
// pending while no process exports it; every other expression must return
// data.
const PENDING = new Set([]);

const started = Date.now();
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "interlock-prom-"));
const children = [];
let failures = 0;
let passes = 0;
function check(ok, message) {
  if (ok) passes += 1;
  else {
    failures += 1;
    console.error(`FAIL ${message}`);
  }
  return ok;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function start(binary, args, log) {
  const out = fs.openSync(path.join(tmp, log), "w");
  const child = spawn(binary, args, {
    stdio: ["ignore", out, out],
    env: { ...process.env, OMP_NUM_THREADS: "1", OPENBLAS_NUM_THREADS: "1" },
  });
  children.push(child);
  return child;
}

function cleanup() {
  for (const c of children) if (c.exitCode === null) c.kill("SIGKILL");
  fs.rmSync(tmp, { recursive: true, force: true });
}
process.on("exit", cleanup);

async function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.unref();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function waitFor(what, fn, ms = 30_000) {
  const until = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await sleep(100);
  }
}

function health(address, service) {
  const args = [`--health_check=${address}`];
  if (service !== undefined) args.push(`--health_service=${service}`);
  const r = spawnSync(WORKER, args, { encoding: "utf8", timeout: 10_000 });
  return `${r.stdout.trim()} rc=${r.status}`;
}

// ---- the expressions under test, from the files ------------------------------

const dashboards = fs.readdirSync(path.join(ROOT, "dashboards/grafana"))
  .filter((f) => f.endsWith(".json"))
  .map((f) => JSON.parse(fs.readFileSync(path.join(ROOT, "dashboards/grafana", f), "utf8")));
const configPath = path.join(ROOT, "dashboards/prometheus/prometheus.yml");
const config = YAML.parse(fs.readFileSync(configPath, "utf8"));
const ruleFiles = config.rule_files.map((f) => path.resolve(path.dirname(configPath), f));
const rules = ruleFiles.flatMap((f) => YAML.parse(fs.readFileSync(f, "utf8")).groups)
  .flatMap((g) => g.rules);

// Grafana's variables as a user would pick them: this run, every block.
function substitute(expr) {
  return expr.replaceAll("$__rate_interval", "10s").replaceAll("$__interval", "2s")
    .replaceAll("$run", RUN).replaceAll("$block", ".*");
}

const expressions = [];
for (const d of dashboards) {
  const panels = d.panels.flatMap((p) => [p, ...(p.panels ?? [])]);
  for (const p of panels) {
    for (const t of p.targets ?? []) {
      expressions.push({ what: `${d.uid} panel '${p.title}' ${t.refId}`, expr: substitute(t.expr) });
    }
  }
}
for (const r of rules.filter((x) => x.record)) {
  expressions.push({ what: `rule ${r.record}`, expr: r.expr });
  expressions.push({ what: `recorded ${r.record}`, expr: `${r.record}{run="${RUN}"}` });
}
// The prometheus-adapter rules behind the autoscaling component, expanded as
// the adapter does for one pod's query.
const adapterFile = path.join(ROOT, "deploy/k8s/components/autoscaling/adapter-rule.yaml");
const adapter = YAML.parse(YAML.parse(fs.readFileSync(adapterFile, "utf8")).data["config.yaml"]);
for (const r of adapter.rules) {
  const series = r.seriesQuery.replace(/\{.*$/, "");
  expressions.push({ what: `adapter rule ${r.name.as}`,
    expr: r.metricsQuery.replaceAll("<<.Series>>", series)
      .replaceAll("<<.LabelMatchers>>", `run="${RUN}"`).replaceAll("<<.GroupBy>>", "instance") });
}
// Metric names an expression needs, through recording rules.
const recordExpr = new Map(rules.filter((x) => x.record).map((r) => [r.record, r.expr]));
function needs(expr, seen = new Set()) {
  const out = new Set();
  for (const name of expr.match(/\binterlock[_:][a-zA-Z0-9_:]+/g) ?? []) {
    if (recordExpr.has(name) && !seen.has(name)) {
      seen.add(name);
      for (const n of needs(recordExpr.get(name), seen)) out.add(n);
    } else {
      out.add(name.replace(/_(sum|count|bucket)$/, ""));
    }
  }
  return out;
}

// ---- the metric families docs/ARCHITECTURE.md lists ---------------------------

// Documented families this test's setup cannot export, with the reason (none at
// present: the extra worker started with --metrics_token_file exports
// interlock_metrics_refused_scrapes_total).
const NOT_EXPORTED = new Map([]);

// The table rows (| `name` | type | labels | meaning |) of the "## Metrics"
// section, each under "### Worker ..." or "### Coordinator ...".
function documentedMetrics() {
  const file = path.join(ROOT, "docs/ARCHITECTURE.md");
  const section = fs.readFileSync(file, "utf8").split(/^## /m)
    .find((s) => s.startsWith("Metrics\n"));
  if (!section) throw new Error(`${file}: no "## Metrics" section`);
  const documented = new Map();
  let proc;
  for (const line of section.split("\n")) {
    const heading = line.match(/^### (\w+)/);
    if (heading) proc = heading[1].toLowerCase();
    const row = line.match(/^\|\s*`(interlock_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|/);
    if (!row) continue;
    check(!documented.has(row[1]), `docs/ARCHITECTURE.md lists ${row[1]} once`);
    documented.set(row[1], { proc, type: row[2],
      labels: [...row[3].matchAll(/`(\w+)`/g)].map((m) => m[1]).sort().join(",") });
  }
  // A family named in the prose must have its row too.
  for (const [, name] of section.matchAll(/`(interlock_\w+)`/g)) {
    check(documented.has(name), `docs/ARCHITECTURE.md names ${name} outside the tables`);
  }
  return documented;
}

// Families of one /metrics text: name -> { type, samples, labels } (label
// names of the samples, without the histogram's "le"), merged into `into`.
function parseExposition(text, into) {
  let family;
  for (const line of text.split("\n")) {
    const type = line.match(/^# TYPE (\S+) (\S+)$/);
    if (type) {
      family = type[1];
      if (!into.has(family)) into.set(family, { type: type[2], samples: 0, labels: new Set() });
      into.get(family).type = type[2];
      continue;
    }
    if (line === "" || line.startsWith("#") || !family) continue;
    into.get(family).samples += 1;
    for (const [, label] of line.matchAll(/(\w+)="(?:[^"\\]|\\.)*"/g)) {
      if (label !== "le") into.get(family).labels.add(label);
    }
  }
}

async function scrape(port, token) {
  const res = await fetch(`http://127.0.0.1:${port}/metrics`,
    token ? { headers: { Authorization: `Bearer ${token}` } } : {});
  if (!res.ok) throw new Error(`scrape of :${port}: HTTP ${res.status}`);
  return res.text();
}

// Every family a process exports is documented under that process with its
// type and labels; every documented family is exported or in NOT_EXPORTED.
function checkDocumented(documented, scraped, prometheusNames) {
  for (const [proc, families] of Object.entries(scraped)) {
    check(families.size > 0, `${proc} /metrics scraped`);
    for (const [name, f] of families) {
      const d = documented.get(name);
      if (!check(d !== undefined,
        `${proc} exports ${name}, not documented in docs/ARCHITECTURE.md`)) continue;
      check(d.proc === proc, `docs/ARCHITECTURE.md lists ${name} under ${d.proc}, ` +
        `exported by the ${proc}`);
      check(d.type === f.type, `docs/ARCHITECTURE.md: ${name} is a ${f.type}, not ${d.type}`);
      // Labels only when a series was there to show them.
      const labels = [...f.labels].sort().join(",");
      check(f.samples === 0 || d.labels === labels,
        `docs/ARCHITECTURE.md: ${name} labels are '${labels}', not '${d.labels}'`);
    }
  }
  for (const name of prometheusNames) {
    check(documented.has(name),
      `Prometheus scraped ${name}, not documented in docs/ARCHITECTURE.md`);
  }
  for (const [name, d] of documented) {
    if (scraped[d.proc]?.has(name)) continue;
    if (NOT_EXPORTED.has(name)) {
      console.log(`documented, not exported by this setup: ${name} (${NOT_EXPORTED.get(name)})`);
      continue;
    }
    check(false, `docs/ARCHITECTURE.md lists ${name} (${d.proc}), which no ${d.proc} exported`);
  }
  const withSeries = Object.values(scraped).flatMap((f) => [...f.values()])
    .filter((f) => f.samples > 0).length;
  console.log(`${documented.size} documented families; scraped ` +
    Object.entries(scraped).map(([p, f]) => `${f.size} ${p}`).join(", ") +
    ` families, ${withSeries} with series (labels checked)`);
  const stale = [...NOT_EXPORTED.keys()]
    .filter((n) => Object.values(scraped).some((f) => f.has(n)));
  check(stale.length === 0, `exported now, drop from NOT_EXPORTED: ${stale.join(", ")}`);
}

// ---- Prometheus HTTP API -------------------------------------------------------

let promUrl;
async function api(pathAndQuery) {
  const res = await fetch(`${promUrl}${pathAndQuery}`);
  const body = await res.json();
  if (body.status !== "success") throw new Error(`${pathAndQuery}: ${body.error}`);
  return body.data;
}
const query = (expr) => api(`/api/v1/query?query=${encodeURIComponent(expr)}`);

async function main() {
  for (const f of [CLI, WORKER]) {
    if (!fs.existsSync(f)) throw new Error(`missing binary ${f}`);
  }
  check(expressions.length > 20, `expressions found in the files: ${expressions.length}`);

  // Workers on free ports; probes' view before any run.
  const workers = [];
  for (let k = 0; k < BLOCKS; ++k) {
    const portFile = path.join(tmp, `w${k}.port`);
    start(WORKER, ["--host=127.0.0.1", "--port=0", "--metrics_port=0", `--port_file=${portFile}`],
      `w${k}.log`);
    workers.push(portFile);
  }
  const ports = [];
  for (const f of workers) {
    const text = await waitFor(`worker port file ${f}`,
      () => fs.existsSync(f) && fs.readFileSync(f, "utf8"));
    const [grpc, metrics] = text.trim().split(/\s+/).map(Number);
    ports.push({ grpc, metrics });
  }
  // One more worker, outside the run, with a metrics token: the families only
  // such a worker registers.
  const metricsToken = "prometheus-test-secret";
  fs.writeFileSync(path.join(tmp, "metrics-token"), `${metricsToken}\n`);
  start(WORKER, ["--host=127.0.0.1", "--port=0", "--metrics_port=0",
    `--port_file=${path.join(tmp, "wt.port")}`,
    `--metrics_token_file=${path.join(tmp, "metrics-token")}`], "wt.log");
  const first = `127.0.0.1:${ports[0].grpc}`;
  check(health(first) === "NOT_SERVING rc=1", `fresh worker health: ${health(first)}`);
  check(health(first, "liveness") === "SERVING rc=0", "fresh worker 'liveness' is SERVING");

  // Prometheus with the committed config: only target files and intervals
  // differ (1 s instead of 5 s, so that a short run gives rates).
  const coordinatorMetrics = await freePort();
  const promPort = await freePort();
  check(health(`127.0.0.1:${promPort}`) === " rc=2", "health check of a closed port exits 2");
  promUrl = `http://127.0.0.1:${promPort}`;
  fs.mkdirSync(path.join(tmp, "targets"));
  fs.writeFileSync(path.join(tmp, "targets/coordinator.json"), JSON.stringify([
    { targets: [`127.0.0.1:${coordinatorMetrics}`], labels: { run: RUN } }]));
  fs.writeFileSync(path.join(tmp, "targets/workers.json"), JSON.stringify([
    { targets: ports.map((p) => `127.0.0.1:${p.metrics}`), labels: { run: RUN } }]));
  const testConfig = structuredClone(config);
  testConfig.global.scrape_interval = "1s";
  testConfig.global.evaluation_interval = "1s";
  testConfig.rule_files = ruleFiles;
  for (const job of testConfig.scrape_configs) {
    for (const sd of job.file_sd_configs) {
      sd.files = sd.files.map((f) => path.join(tmp, f));
      sd.refresh_interval = "1s";
    }
  }
  fs.writeFileSync(path.join(tmp, "prometheus.yml"), YAML.stringify(testConfig));
  start(PROMETHEUS, [`--config.file=${path.join(tmp, "prometheus.yml")}`,
    `--storage.tsdb.path=${path.join(tmp, "data")}`,
    `--web.listen-address=127.0.0.1:${promPort}`, "--log.level=warn"], "prometheus.log");
  await waitFor("prometheus to be ready", async () => {
    try {
      return (await fetch(`${promUrl}/-/ready`)).ok;
    } catch {
      return false;
    }
  });

  // The run, through the workers, with checkpoints.
  const args = ["train", `--config=${path.join(ROOT, "tests/deploy/metrics_run.pbtxt")}`,
    "--engine=cluster", `--workers=${ports.map((p) => `127.0.0.1:${p.grpc}`).join(",")}`,
    `--metrics-port=${coordinatorMetrics}`, `--out=${path.join(tmp, "out")}`, "--quiet",
    "--checkpoint-every=10", `--checkpoint-dir=${path.join(tmp, "ckpt")}`];
  const coordinator = start(CLI, args, "coordinator.log");

  // Poll every expression until each has returned data once.
  const seen = new Map();
  let exported = new Set();
  const scraped = { worker: new Map(), coordinator: new Map() };
  while (Date.now() - started < DEADLINE_MS) {
    // The coordinator serves /metrics only while the run lasts (and not
    // before it has loaded its data): a failed scrape is retried, and the
    // checks below fail if none succeeded.
    if (coordinator.exitCode === null) {
      try {
        parseExposition(await scrape(coordinatorMetrics), scraped.coordinator);
      } catch {}
    }
    const names = await query('count by (__name__) ({__name__=~"interlock_.+"})');
    for (const s of names.result) {
      exported.add(s.metric.__name__.replace(/_(sum|count|bucket)$/, ""));
    }
    for (const e of expressions) {
      if (seen.get(e.what)) continue;
      const r = await query(e.expr);
      if (r.result.length > 0) seen.set(e.what, true);
    }
    const waiting = expressions.filter((e) => !seen.get(e.what) &&
      ![...needs(e.expr)].some((n) => PENDING.has(n) && !exported.has(n)));
    if (!waiting.length) break;
    if (coordinator.exitCode !== null) break;
    await sleep(1000);
  }
  // The workers of the run (configured) and the one with a metrics token.
  for (const p of ports) parseExposition(await scrape(p.metrics), scraped.worker);
  const tokenPorts = (await waitFor("worker port file wt.port", () =>
    fs.existsSync(path.join(tmp, "wt.port")) && fs.readFileSync(path.join(tmp, "wt.port"), "utf8")))
    .trim().split(/\s+/);
  parseExposition(await scrape(Number(tokenPorts[1]), metricsToken), scraped.worker);
  checkDocumented(documentedMetrics(), scraped, exported);

  // A healthy run raises no alert, not even a pending one.
  const alerts = await query(`ALERTS{run="${RUN}"}`);
  check(alerts.result.length === 0, `alerts during a healthy run: ${
    alerts.result.map((a) => `${a.metric.alertname}(${a.metric.alertstate})`).join(", ")}`);
  const serving = health(first);
  check(serving === "SERVING rc=0", `configured worker health: ${serving}`);

  // Template variables (label_values queries) list this run and its blocks.
  const runs = await api(`/api/v1/label/run/values?match[]=interlock_coordinator_step`);
  check(runs.includes(RUN), `run variable lists ${RUN}: ${runs}`);
  const blocks = await api(`/api/v1/label/block/values?match[]=${encodeURIComponent(
    `interlock_worker_step{run=~"${RUN}"}`)}`);
  check(blocks.sort().join() === [...Array(BLOCKS).keys()].join(), `block variable: ${blocks}`);

  const pending = [];
  for (const e of expressions) {
    const missing = [...needs(e.expr)].filter((n) => PENDING.has(n) && !exported.has(n));
    if (seen.get(e.what)) {
      check(true, e.what);
    } else if (missing.length) {
      pending.push(`${e.what} (needs ${missing.join(", ")})`);
    } else {
      check(false, `${e.what}: no data during the run: ${e.expr}`);
    }
  }
  const landed = [...PENDING].filter((n) => exported.has(n));
  if (landed.length) console.log(`now exported, drop from PENDING: ${landed.join(", ")}`);
  for (const p of pending) console.log(`pending: ${p}`);
  if (coordinator.exitCode === null) coordinator.kill("SIGTERM");
  if (failures) {
    for (const log of fs.readdirSync(tmp).filter((f) => f.endsWith(".log"))) {
      const text = fs.readFileSync(path.join(tmp, log), "utf8");
      console.error(`--- ${log} (tail)\n${text.slice(-1500)}`);
    }
  }
  console.log(`${expressions.length} expressions, ${pending.length} pending; ` +
    `${((Date.now() - started) / 1000).toFixed(1)} s`);
}

try {
  await main();
} catch (e) {
  check(false, e.stack ?? String(e));
}
console.log(`${passes} passed, ${failures} failed`);
process.exit(failures ? 1 : 0);
