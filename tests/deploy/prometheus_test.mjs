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
// 'liveness' SERVING) before the run, SERVING once configured.
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
  while (Date.now() - started < DEADLINE_MS) {
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
