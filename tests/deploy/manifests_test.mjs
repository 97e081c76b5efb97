// Renders every overlay of deploy/k8s with `kubectl kustomize`, validates
// every object against the Kubernetes API schema (kubernetes-models; the
// Prometheus Operator's PodMonitor through its own models package) and
// checks the invariants docs/OPERATIONS.md promises: probes, non-root,
// read-only root file system, limits, labels, one block per worker
// Deployment with its headless Service and PodDisruptionBudget, the
// coordinator's flags pointing at those Services, and a default-deny network
// whose only openings are the coordinator, neighbouring blocks, Prometheus
// and DNS. Elastic overlays (extra replicas per block, interlock/role:
// extra) also: extras that join through the coordinator's membership Service
// as their own block at their pod IP and drain within their grace period,
// primaries whose Services and budgets never select an extra, the
// coordinator's membership and store ports behind its Service, and the
// openings for the membership service, the store and the replicas' Gloo
// traffic.
//
//   node tests/deploy/manifests_test.mjs [REPO_ROOT]
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";

const ROOT = path.resolve(
  process.argv[2] ?? path.join(path.dirname(fileURLToPath(import.meta.url)), "../.."));
const KUBECTL = process.env.KUBECTL ?? "kubectl";
const OVERLAYS = path.join(ROOT, "deploy/k8s/overlays");
const DASHBOARDS = path.join(ROOT, "dashboards/grafana");

let checks = 0;
let failures = 0;
function check(ok, message) {
  checks += 1;
  if (!ok) {
    failures += 1;
    console.error(`FAIL ${message}`);
  }
  return ok;
}

// ---- schema validation -------------------------------------------------

async function modelClass(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/")
    ? apiVersion.split("/")
    : ["", apiVersion];
  const module = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`
    : `kubernetes-models/${group ? `${group}/` : ""}${version}/${kind}`;
  try {
    return (await import(module))[kind] ?? null;
  } catch {
    return null;
  }
}

// Returns the schema errors of one object ([] when valid).
async function schemaErrors(obj) {
  const Model = await modelClass(obj.apiVersion ?? "", obj.kind ?? "");
  if (!Model) return [`no schema for ${obj.apiVersion} ${obj.kind}`];
  try {
    new Model(obj).validate();
    return [];
  } catch (e) {
    return [e.message];
  }
}

// The validator must reject what the API server would: if it accepted these,
// every "valid" below would mean nothing.
async function checkValidatorRejects() {
  const bad = [
    { apiVersion: "apps/v1", kind: "Deployment", metadata: { name: "x" },
      spec: { selector: { matchLabels: { a: "b" } },
        template: { metadata: { labels: { a: "b" } },
          spec: { containers: [{ name: "c", image: "i",
            resources: { limits: { cpu: "two" } } }] } } } },
    { apiVersion: "v1", kind: "Service", metadata: { name: "x" },
      spec: { ports: [{ port: "grpc" }] } },
    { apiVersion: "monitoring.coreos.com/v1", kind: "PodMonitor",
      metadata: { name: "x" }, spec: { podMetricsEndpoints: [{ interval: 5 }] } },
    { apiVersion: "example.com/v1", kind: "Unknown", metadata: { name: "x" } },
  ];
  for (const obj of bad) {
    check((await schemaErrors(obj)).length > 0,
      `validator accepted an invalid ${obj.kind}`);
  }
}

// ---- helpers -------------------------------------------------------------

function render(dir) {
  const text = execFileSync(KUBECTL, ["kustomize", dir], {
    encoding: "utf8", maxBuffer: 64 << 20 });
  return YAML.parseAllDocuments(text).map((d) => {
    if (d.errors.length) throw new Error(`${dir}: ${d.errors[0].message}`);
    return d.toJS();
  }).filter((o) => o);
}

const CLUSTER_SCOPED = new Set(["Namespace", "ClusterRole", "ClusterRoleBinding",
  "PersistentVolume", "StorageClass", "APIService"]);

// Kubernetes quantity ("500m", "3Gi", "2") in base units.
function quantity(q) {
  const m = /^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$/.exec(String(q));
  if (!m) return NaN;
  const scale = { m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10,
    Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40 }[m[2]] ?? 1;
  return Number(m[1]) * scale;
}

const subset = (small, big) =>
  Object.entries(small ?? {}).every(([k, v]) => big?.[k] === v);
const selects = (selector, labels) =>
  !selector?.matchExpressions?.length && subset(selector?.matchLabels, labels);

function flagValue(args, name) {
  const prefixes = [`--${name}=`, `--${name.replaceAll("-", "_")}=`];
  const hits = (args ?? []).filter((a) => prefixes.some((p) => a.startsWith(p)));
  return hits.length === 1 ? hits[0].slice(hits[0].indexOf("=") + 1) : undefined;
}

// The downward-API field behind `$(VAR)` in an argument ("status.podIP",
// "metadata.labels['interlock/block']"), or undefined.
function envField(container, value) {
  const m = /^\$\((\w+)\)$/.exec(value ?? "");
  if (!m) return undefined;
  return container.env?.find((e) => e.name === m[1])?.valueFrom?.fieldRef?.fieldPath;
}

const isExtra = (d) => d.spec.template.metadata.labels?.["interlock/role"] === "extra";
const blockOf = (d) => d.spec.template.metadata.labels?.["interlock/block"];

// training.microbatches of the run config the coordinator reads (1 unset).
function runMicrobatches(byKind) {
  const text = byKind("ConfigMap").flatMap((c) => Object.entries(c.data ?? {}))
    .find(([k]) => k.endsWith(".pbtxt"))?.[1] ?? "";
  return Number(/\bmicrobatches:\s*(\d+)/.exec(text)?.[1] ?? 1);
}

// The volume (from the pod spec) mounted at or above `file` in `container`.
function volumeFor(podSpec, container, file) {
  const mount = (container.volumeMounts ?? [])
    .filter((m) => file === m.mountPath || file.startsWith(`${m.mountPath}/`))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  return mount && podSpec.volumes?.find((v) => v.name === mount.name);
}

// ---- invariants ------------------------------------------------------------

function checkPodSpec(where, template, byKind) {
  const spec = template.spec ?? {};
  check(spec.securityContext?.runAsNonRoot === true, `${where}: runAsNonRoot`);
  check(spec.securityContext?.runAsUser > 0, `${where}: runAsUser not root`);
  check(spec.securityContext?.seccompProfile?.type === "RuntimeDefault",
    `${where}: seccompProfile RuntimeDefault`);
  check(spec.automountServiceAccountToken === false,
    `${where}: no service account token`);
  check(!spec.hostNetwork && !spec.hostPID && !spec.hostIPC, `${where}: no host namespaces`);
  for (const v of spec.volumes ?? []) {
    check(!v.hostPath, `${where}: volume ${v.name} is a hostPath`);
    if (v.configMap) {
      check(byKind("ConfigMap").some((c) => c.metadata.name === v.configMap.name),
        `${where}: ConfigMap ${v.configMap.name} is not in the render`);
    }
    if (v.persistentVolumeClaim) {
      check(byKind("PersistentVolumeClaim").some(
        (c) => c.metadata.name === v.persistentVolumeClaim.claimName),
        `${where}: PVC ${v.persistentVolumeClaim.claimName} is not in the render`);
    }
    if (v.secret) {
      check(v.secret.secretName === "interlock-token",
        `${where}: secret volume ${v.name} is not interlock-token`);
    }
  }
  check((spec.containers ?? []).length > 0, `${where}: no containers`);
  for (const c of spec.containers ?? []) {
    const cw = `${where}/${c.name}`;
    const sc = c.securityContext ?? {};
    check(sc.allowPrivilegeEscalation === false, `${cw}: allowPrivilegeEscalation false`);
    check(sc.readOnlyRootFilesystem === true, `${cw}: readOnlyRootFilesystem`);
    check(sc.privileged !== true && sc.runAsNonRoot !== false, `${cw}: privileged or root`);
    check((sc.capabilities?.drop ?? []).includes("ALL"), `${cw}: capabilities drop ALL`);
    check(!(sc.capabilities?.add ?? []).length, `${cw}: adds capabilities`);
    for (const r of ["cpu", "memory"]) {
      const req = quantity(c.resources?.requests?.[r]);
      const lim = quantity(c.resources?.limits?.[r]);
      check(req > 0 && lim > 0 && req <= lim, `${cw}: ${r} request/limit set, request <= limit`);
    }
    for (const p of ["startupProbe", "livenessProbe", "readinessProbe"]) {
      check(c[p] !== undefined, `${cw}: ${p}`);
    }
    for (const m of c.volumeMounts ?? []) {
      check(spec.volumes?.some((v) => v.name === m.name), `${cw}: mount ${m.name} has no volume`);
    }
    const tmp = volumeFor(spec, c, "/tmp");
    check(tmp?.emptyDir !== undefined, `${cw}: /tmp is an emptyDir`);
  }
}

// Secure by default: the binaries listen on 127.0.0.1 unless told, which
// other pods (peers, Prometheus) and the kubelet's probes cannot reach. A
// listener flag must name every interface or the pod IP, and no manifest
// may pass --insecure (the token allows listening beyond loopback).
function reachableHost(container, value) {
  return value === "0.0.0.0" || value === "::" || value === "[::]" ||
    envField(container, value) === "status.podIP";
}
const insecure = (c) => (c.args ?? []).some((a) => /^--insecure(=|$)/.test(a));

function portNumber(container, nameOrNumber) {
  if (typeof nameOrNumber === "number") return nameOrNumber;
  return container.ports?.find((p) => p.name === nameOrNumber)?.containerPort;
}

// What every worker Deployment's container (primary or extra) must have:
// ports, probes, preStop, token, device. Returns the preStop sleep.
function checkWorkerContainer(w, d) {
  const c = d.spec.template.spec.containers[0];
  const grpc = portNumber(c, "grpc");
  const metrics = portNumber(c, "metrics");
  check(flagValue(c.args, "port") === String(grpc), `${w}: --port is the grpc port`);
  check(flagValue(c.args, "metrics_port") === String(metrics), `${w}: --metrics_port is the metrics port`);
  for (const p of ["startupProbe", "livenessProbe", "readinessProbe"]) {
    check(c[p]?.grpc?.port === grpc, `${w}: ${p} is a native gRPC probe on the grpc port`);
  }
  check(c.startupProbe?.grpc?.service === "liveness" && c.livenessProbe?.grpc?.service === "liveness",
    `${w}: startup/liveness probes ask the 'liveness' health entry`);
  check(["", undefined, "interlock.v1.Worker"].includes(c.readinessProbe?.grpc?.service),
    `${w}: readiness asks whether a block is configured`);
  const stop = c.lifecycle?.preStop?.exec?.command;
  const sleep = stop?.[0] === "sleep" ? Number(stop[1]) : NaN;
  check(sleep > 0, `${w}: preStop sleep`);
  // preStop, then SIGTERM: health NOT_SERVING and 5 s grace in WorkerServer.
  check(d.spec.template.spec.terminationGracePeriodSeconds >= sleep + 5 + 1,
    `${w}: terminationGracePeriodSeconds covers preStop + graceful shutdown`);
  const token = flagValue(c.args, "token_file") ?? flagValue(c.args, "token-file");
  check(token && volumeFor(d.spec.template.spec, c, token)?.secret,
    `${w}: --token_file is read from the Secret volume`);
  const host = flagValue(c.args, "host");
  check(reachableHost(c, host), `${w}: --host=${host} is reachable from other pods (the default is loopback)`);
  const metricsHost = flagValue(c.args, "metrics_host") ?? host;
  check(reachableHost(c, metricsHost), `${w}: /metrics on ${metricsHost} is reachable by Prometheus`);
  check(!insecure(c), `${w}: no --insecure (the token allows --host beyond loopback)`);
  checkDevice(w, c);
  return sleep;
}

function checkWorkers(workers, byKind, extras) {
  const blocks = workers.map(blockOf);
  const k = workers.length;
  check(k > 0, "no worker Deployments");
  check([...blocks].sort((a, b) => a - b).join() === [...Array(k).keys()].join(),
    `blocks are not 0..${k - 1}: ${blocks}`);
  const services = byKind("Service");
  const pdbs = byKind("PodDisruptionBudget");
  for (const d of workers) {
    const block = blockOf(d);
    const w = `Deployment ${d.metadata.name}`;
    const labels = d.spec.template.metadata.labels;
    check(d.metadata.name === `interlock-block-${block}`, `${w}: name matches block ${block}`);
    check(d.metadata.labels?.["interlock/block"] === block, `${w}: object label block`);
    check(d.spec.replicas === 1, `${w}: one replica per block`);
    check(d.spec.strategy?.type === "Recreate", `${w}: Recreate (never two replicas)`);
    check(selects(d.spec.selector, labels) && d.spec.selector.matchLabels["interlock/block"] === block,
      `${w}: selector matches its pods, by block`);
    const c = d.spec.template.spec.containers[0];
    const grpc = portNumber(c, "grpc");
    checkWorkerContainer(w, d);
    for (const e of extras) {
      check(!selects(d.spec.selector, e.spec.template.metadata.labels),
        `${w}: selector leaves out the pods of ${e.metadata.name}`);
    }
    if (extras.length) {
      check(envField(c, flagValue(c.args, "collective_host")) === "status.podIP",
        `${w}: --collective_host is the pod IP (the block's replicas reach it there)`);
    }
    const svc = services.find((s) => s.metadata.name === d.metadata.name);
    if (check(svc, `${w}: headless Service of the same name`)) {
      check(svc.spec.clusterIP === "None", `Service ${svc.metadata.name}: headless`);
      check(svc.spec.publishNotReadyAddresses === true,
        `Service ${svc.metadata.name}: publishes not-ready workers (ready = configured)`);
      check(subset(svc.spec.selector, labels) && svc.spec.selector["interlock/block"] === block,
        `Service ${svc.metadata.name}: selects block ${block}`);
      const sp = svc.spec.ports?.find((p) => p.name === "grpc");
      check(sp && portNumber(c, sp.targetPort) === grpc, `Service ${svc.metadata.name}: grpc port`);
      // dns:///interlock-block-K must resolve to the configured primary only.
      for (const e of extras) {
        check(!subset(svc.spec.selector, e.spec.template.metadata.labels),
          `Service ${svc.metadata.name}: does not select the pods of ${e.metadata.name}`);
      }
    }
    const pdb = pdbs.filter((p) => selects(p.spec.selector, labels));
    check(pdb.length === 1 && pdb[0].spec.selector.matchLabels["interlock/block"] === block,
      `${w}: exactly one PodDisruptionBudget, for this block`);
  }
  return { k, grpc: portNumber(workers[0]?.spec.template.spec.containers[0] ?? {}, "grpc") };
}

// Extra replicas of a block (elastic overlays): a Deployment per block,
// none until scaled, whose pods join the run through the coordinator's
// membership Service as replicas of their own block, at their pod IP, and
// drain (Leave, at most --drain_timeout) within their grace period; a budget
// that lets a drain take them one at a time.
function checkExtras(extras, workers, job, byKind) {
  const pdbs = byKind("PodDisruptionBudget");
  const services = byKind("Service");
  const seen = new Set();
  for (const d of extras) {
    const block = blockOf(d);
    const w = `Deployment ${d.metadata.name}`;
    const labels = d.spec.template.metadata.labels;
    const spec = d.spec.template.spec;
    check(d.metadata.name === `interlock-block-${block}-extra`, `${w}: name matches block ${block}`);
    check(workers.some((p) => blockOf(p) === block), `${w}: block ${block} has a primary`);
    check(!seen.has(block), `${w}: one extras Deployment for block ${block}`);
    seen.add(block);
    check(d.metadata.labels?.["interlock/role"] === "extra", `${w}: object label role extra`);
    // 0 until scaled; unset where an autoscaler owns the count.
    const scaled = byKind("HorizontalPodAutoscaler").some((h) =>
      h.spec.scaleTargetRef?.kind === "Deployment" && h.spec.scaleTargetRef?.name === d.metadata.name);
    check(scaled ? d.spec.replicas === undefined : d.spec.replicas === 0,
      `${w}: ${scaled ? "replicas left to its autoscaler" : "no extra replicas until scaled"}`);
    check(selects(d.spec.selector, labels) && d.spec.selector.matchLabels["interlock/block"] === block &&
      d.spec.selector.matchLabels["interlock/role"] === "extra", `${w}: selector matches its pods, by block and role`);
    for (const p of workers) {
      check(!selects(d.spec.selector, p.spec.template.metadata.labels),
        `${w}: selector leaves out the primary ${p.metadata.name}`);
    }
    const sleep = checkWorkerContainer(w, d);
    const c = spec.containers[0];
    const grpc = portNumber(c, "grpc");
    // --coordinator: a Service of the coordinator exposing its membership port.
    const target = flagValue(c.args, "coordinator") ?? "";
    const [host, port] = target.split(":");
    const svc = services.find((s) => s.metadata.name === host);
    const jobContainer = job?.spec.template.spec.containers[0];
    if (check(svc && job && subset(svc.spec.selector, job.spec.template.metadata.labels),
      `${w}: --coordinator=${target} names a Service of the coordinator`)) {
      const sp = svc.spec.ports?.find((p) => String(p.port) === port);
      check(sp && portNumber(jobContainer, sp.targetPort ?? sp.port) ===
        Number(flagValue(jobContainer.args, "coordinator-port")),
        `${w}: Service ${host} exposes port ${port} on the coordinator's --coordinator_port`);
    }
    const blockArg = flagValue(c.args, "block");
    check(blockArg === block || envField(c, blockArg) === "metadata.labels['interlock/block']",
      `${w}: --block=${blockArg} is its block label ${block}`);
    const advertise = flagValue(c.args, "advertise") ?? "";
    const colon = advertise.lastIndexOf(":");
    check(envField(c, advertise.slice(0, colon)) === "status.podIP" &&
      Number(advertise.slice(colon + 1)) === grpc,
      `${w}: --advertise=${advertise} is the pod IP and the grpc port`);
    check(envField(c, flagValue(c.args, "collective_host")) === "status.podIP",
      `${w}: --collective_host is the pod IP`);
    const config = flagValue(c.args, "run_config");
    const configVolume = config && volumeFor(spec, c, config);
    const configMap = configVolume?.configMap &&
      byKind("ConfigMap").find((m) => m.metadata.name === configVolume.configMap.name);
    const jobConfig = job && volumeFor(job.spec.template.spec, jobContainer,
      flagValue(jobContainer.args, "config") ?? "")?.configMap?.name;
    check(configMap?.data?.[path.basename(config)] && configMap.metadata.name === jobConfig,
      `${w}: --run_config is the coordinator's run config`);
    const drain = Number(flagValue(c.args, "drain_timeout") ?? 120);
    // preStop, then SIGTERM: Leave (at most --drain_timeout), then the
    // worker's graceful shutdown (5 s).
    check(spec.terminationGracePeriodSeconds >= sleep + drain + 5 + 1,
      `${w}: terminationGracePeriodSeconds ${spec.terminationGracePeriodSeconds} covers ` +
      `preStop ${sleep} s + --drain_timeout ${drain} s + shutdown`);
    const pdb = pdbs.filter((p) => selects(p.spec.selector, labels));
    if (check(pdb.length === 1, `${w}: exactly one PodDisruptionBudget`)) {
      check(pdb[0].spec.maxUnavailable >= 1 && pdb[0].spec.minAvailable === undefined,
        `PodDisruptionBudget ${pdb[0].metadata.name}: maxUnavailable (extras drain one at a time)`);
      check(workers.every((p) => !selects(pdb[0].spec.selector, p.spec.template.metadata.labels)),
        `PodDisruptionBudget ${pdb[0].metadata.name}: selects no primary`);
    }
  }
}

// The coordinator of an elastic overlay: membership service and store on
// fixed ports behind a Service, the store advertised at the pod IP.
function checkCoordinatorMembership(job, byKind) {
  const w = `Job ${job.metadata.name}`;
  const c = job.spec.template.spec.containers[0];
  const svc = byKind("Service").filter((s) => subset(s.spec.selector, job.spec.template.metadata.labels) &&
    Object.keys(s.spec.selector ?? {}).length);
  if (!check(svc.length === 1, `${w}: one Service selects the coordinator`)) return;
  check(svc[0].spec.clusterIP !== "None", `Service ${svc[0].metadata.name}: has a cluster IP`);
  for (const flag of ["coordinator-port", "collective-port"]) {
    const port = Number(flagValue(c.args, flag));
    check(port > 0 && c.ports?.some((p) => p.containerPort === port),
      `${w}: --${flag}=${port} is a fixed container port`);
    check(svc[0].spec.ports?.some((p) => portNumber(c, p.targetPort ?? p.port) === port),
      `Service ${svc[0].metadata.name}: exposes the coordinator's --${flag}`);
  }
  check(envField(c, flagValue(c.args, "collective-host")) === "status.podIP",
    `${w}: --collective_host is the pod IP (where the workers reach the store)`);
  const host = flagValue(c.args, "coordinator-host");
  check(reachableHost(c, host),
    `${w}: --coordinator-host=${host} is reachable by the workers (the default is loopback)`);
}

// A worker runs its block on a GPU (--device=cuda[:N]) exactly when its pod
// requests one, and on one of those it requests.
function checkDevice(w, c) {
  const given = (c.args ?? []).filter((a) => a.startsWith("--device"));
  check(given.length <= 1, `${w}: --device at most once`);
  const device = flagValue(c.args, "device") ?? "cpu";
  const m = /^(cpu|cuda)(?::(\d+))?$/.exec(device);
  if (!check(m && !(m[1] === "cpu" && m[2]), `${w}: --device=${device} is cpu, cuda or cuda:N`)) return;
  const gpus = Number(c.resources?.limits?.["nvidia.com/gpu"] ?? 0);
  check((m[1] === "cuda") === gpus > 0,
    `${w}: --device=${device} with ${gpus} GPU(s) requested (cuda needs a GPU, a GPU needs cuda)`);
  if (m[1] === "cuda") check(Number(m[2] ?? 0) < gpus, `${w}: --device=${device} is one of its ${gpus} GPU(s)`);
}

function checkCoordinator(jobs, chain, byKind) {
  if (!check(jobs.length === 1, `one coordinator Job (got ${jobs.length})`)) return;
  const job = jobs[0];
  const w = `Job ${job.metadata.name}`;
  const spec = job.spec.template.spec;
  const c = spec.containers[0];
  check(job.spec.parallelism === 1 && job.spec.completions === 1, `${w}: one replica`);
  const metrics = portNumber(c, "metrics");
  check(flagValue(c.args, "metrics-port") === String(metrics), `${w}: --metrics-port is the metrics port`);
  for (const p of ["startupProbe", "livenessProbe", "readinessProbe"]) {
    check(c[p]?.httpGet?.path === "/metrics" && portNumber(c, c[p]?.httpGet?.port) === metrics,
      `${w}: ${p} is an HTTP GET of /metrics`);
  }
  const metricsHost = flagValue(c.args, "metrics-host");
  check(reachableHost(c, metricsHost),
    `${w}: --metrics-host=${metricsHost} is reachable by Prometheus and the probes (the default is loopback)`);
  check(!insecure(c), `${w}: no --insecure (the token allows listeners beyond loopback)`);
  const expected = [...Array(chain.k).keys()]
    .map((b) => `dns:///interlock-block-${b}:${chain.grpc}`).join(",");
  check(flagValue(c.args, "workers") === expected,
    `${w}: --workers is the blocks' Services in order (${expected})`);
  const config = flagValue(c.args, "config");
  const configVolume = config && volumeFor(spec, c, config);
  const configMap = configVolume?.configMap &&
    byKind("ConfigMap").find((m) => m.metadata.name === configVolume.configMap.name);
  check(configMap?.data?.[path.basename(config)], `${w}: --config is a key of the run ConfigMap`);
  const runVar = c.env?.find((e) =>
    e.valueFrom?.fieldRef?.fieldPath === "metadata.labels['interlock/run']")?.name;
  for (const flag of ["checkpoint-dir", "out"]) {
    const dir = flagValue(c.args, flag);
    check(dir && volumeFor(spec, c, dir)?.persistentVolumeClaim,
      `${w}: --${flag} is on a persistent volume`);
    check(runVar && dir?.includes(`/$(${runVar})/`), `${w}: --${flag} is a folder of its own run`);
  }
  const token = flagValue(c.args, "token-file");
  check(token && volumeFor(spec, c, token)?.secret, `${w}: --token-file is read from the Secret volume`);
  const pdb = byKind("PodDisruptionBudget").filter((p) =>
    selects(p.spec.selector, job.spec.template.metadata.labels));
  check(pdb.length === 1, `${w}: exactly one PodDisruptionBudget`);
}

// Who may talk to a pod, and whom it may call, as sets of "peer:port".
function networkPeers(policies, labels, direction, pods) {
  const out = new Set();
  const peerName = (peer) => {
    if (peer.ipBlock) return "ipBlock";
    if (peer.namespaceSelector) {
      const ns = peer.namespaceSelector.matchLabels?.["kubernetes.io/metadata.name"];
      const app = peer.podSelector?.matchLabels?.["app.kubernetes.io/name"];
      if (ns === "monitoring" && app === "prometheus") return "prometheus";
      if (ns === "kube-system" && peer.podSelector?.matchLabels?.["k8s-app"] === "kube-dns") return "dns";
      return "other-namespace";
    }
    const matched = pods.filter((p) => selects(peer.podSelector, p.labels)).map((p) => p.name);
    return matched.length === pods.filter((p) => p.name.startsWith("block-")).length &&
      matched.every((n) => n.startsWith("block-")) ? "blocks" : matched.join("|") || "nothing";
  };
  for (const p of policies) {
    if (!selects(p.spec.podSelector, labels)) continue;
    for (const rule of p.spec[direction] ?? []) {
      const peers = rule[direction === "ingress" ? "from" : "to"];
      const ports = (rule.ports ?? [{ port: "any" }]).map((x) => x.port ?? "any");
      for (const peer of peers ?? [{ any: true }]) {
        const name = peer.any ? "anyone" : peerName(peer);
        for (const port of ports) out.add(`${name}:${port}`);
      }
    }
  }
  return [...out].sort().join(" ");
}

function checkNetwork(name, objects, workers, job, extras) {
  const policies = objects.filter((o) => o.kind === "NetworkPolicy");
  const deny = policies.filter((p) => Object.keys(p.spec.podSelector ?? {}).length === 0 ||
    (Object.keys(p.spec.podSelector.matchLabels ?? {}).length === 0 &&
     !(p.spec.podSelector.matchExpressions ?? []).length));
  check(deny.length === 1 && deny[0].spec.policyTypes?.includes("Ingress") &&
    deny[0].spec.policyTypes?.includes("Egress") && !deny[0].spec.ingress?.length &&
    !deny[0].spec.egress?.length, "one default-deny NetworkPolicy (ingress and egress)");
  const pods = [...workers, ...extras].map((d) => ({
    name: `block-${blockOf(d)}${isExtra(d) ? "-extra" : ""}`,
    block: Number(blockOf(d)),
    labels: d.spec.template.metadata.labels }))
    .sort((a, b) => (a.name < b.name ? -1 : 1));
  if (job) pods.push({ name: "coordinator", labels: job.spec.template.metadata.labels });
  const k = workers.length;
  const elastic = extras.length > 0;
  // A block's pods as networkPeers names them: its primary, and its extras.
  const group = (b) => pods.filter((p) => p.block === b).map((p) => p.name).join("|");
  for (const pod of pods) {
    let ingress;
    let egress;
    if (pod.name === "coordinator") {
      ingress = ["prometheus:metrics", elastic ? "blocks:membership blocks:store" : null]
        .filter((x) => x).sort().join(" ");
      egress = "blocks:7070 dns:53";
    } else {
      const b = pod.block;
      // Replicas of one block reduce over Gloo: any TCP port, both ways.
      const replicas = extras.some((e) => Number(blockOf(e)) === b) ? `${group(b)}:any` : null;
      ingress = [b > 0 ? `${group(b - 1)}:grpc` : null, "coordinator:grpc", "prometheus:metrics", replicas]
        .filter((x) => x).sort().join(" ");
      egress = [b + 1 < k ? `${group(b + 1)}:7070` : null, "dns:53", replicas,
        elastic ? "coordinator:7071 coordinator:7072" : null]
        .filter((x) => x).join(" ").split(" ").sort().join(" ");
    }
    const gotIn = networkPeers(policies, pod.labels, "ingress", pods);
    const gotOut = networkPeers(policies, pod.labels, "egress", pods);
    check(gotIn === ingress, `${name}: ${pod.name}: ingress admits '${gotIn}', expected '${ingress}'`);
    check(gotOut === egress, `${name}: ${pod.name}: egress admits '${gotOut}', expected '${egress}'`);
  }
}

function checkMonitoring(byKind, workers, job, extras) {
  const monitors = byKind("PodMonitor");
  const targets = [
    ["interlock-worker", workers[0]?.spec.template], ["interlock-coordinator", job?.spec.template],
    ...extras.map((e) => ["interlock-worker", e.spec.template])];
  for (const [jobName, template] of targets) {
    if (!template) continue;
    const m = monitors.filter((pm) => selects(pm.spec.selector, template.metadata.labels));
    if (!check(m.length === 1, `one PodMonitor selects ${jobName} pods`)) continue;
    for (const ep of m[0].spec.podMetricsEndpoints) {
      check(template.spec.containers.some((c) => c.ports?.some((p) => p.name === ep.port)),
        `PodMonitor ${m[0].metadata.name}: port ${ep.port} exists on the pods`);
      const r = ep.relabelings ?? [];
      check(r.some((x) => x.targetLabel === "job" && x.replacement === jobName),
        `PodMonitor ${m[0].metadata.name}: job label ${jobName} (alerts use it)`);
      check(r.some((x) => x.targetLabel === "run" &&
        x.sourceLabels?.[0] === "__meta_kubernetes_pod_label_interlock_run"),
        `PodMonitor ${m[0].metadata.name}: run label from the pod's interlock/run`);
    }
  }
}

function checkDashboards(byKind) {
  const maps = byKind("ConfigMap").filter((c) => c.metadata.labels?.grafana_dashboard === "1");
  if (!check(maps.length === 1, "one ConfigMap labelled grafana_dashboard=1")) return;
  for (const f of fs.readdirSync(DASHBOARDS).filter((n) => n.endsWith(".json"))) {
    check(maps[0].data?.[f] === fs.readFileSync(path.join(DASHBOARDS, f), "utf8"),
      `dashboard ConfigMap carries ${f} exactly as in dashboards/grafana`);
  }
}

function checkAutoscaling(byKind, workers, extras) {
  const hpas = byKind("HorizontalPodAutoscaler");
  if (!hpas.length) return;
  const adapter = byKind("ConfigMap").find((c) => c.data?.["config.yaml"]?.includes("rules"));
  const rules = adapter ? YAML.parse(adapter.data["config.yaml"]).rules ?? [] : [];
  const served = new Set(rules.map((r) => r.name?.as));
  check(rules.every((r) => r.seriesQuery && r.metricsQuery && r.resources?.overrides?.pod),
    "adapter rules have seriesQuery, metricsQuery and a pod resource");
  // A primary is one pod (the one --workers lists): autoscalers scale the
  // extras, within the run's replica limit (replicas <= micro-batches).
  check(hpas.length === extras.length && extras.length > 0,
    "one HorizontalPodAutoscaler per block's extras Deployment");
  const microbatches = runMicrobatches(byKind);
  for (const h of hpas) {
    check(extras.some((d) => d.metadata.name === h.spec.scaleTargetRef?.name &&
      h.spec.scaleTargetRef?.kind === "Deployment"), `HPA ${h.metadata.name}: targets a block's extras`);
    check(h.spec.minReplicas >= 1 && h.spec.maxReplicas >= h.spec.minReplicas,
      `HPA ${h.metadata.name}: 1 <= minReplicas <= maxReplicas`);
    check(h.spec.maxReplicas + 1 <= microbatches,
      `HPA ${h.metadata.name}: maxReplicas ${h.spec.maxReplicas} + the primary <= ` +
      `training.microbatches ${microbatches}`);
    for (const m of h.spec.metrics ?? []) {
      check(m.type === "Pods" && served.has(m.pods?.metric?.name),
        `HPA ${h.metadata.name}: metric ${m.pods?.metric?.name} is served by the adapter rule`);
    }
  }
}

async function checkOverlay(dir) {
  const name = path.basename(dir);
  let objects;
  try {
    objects = render(dir);
  } catch (e) {
    check(false, `${name}: kubectl kustomize failed: ${e.message}`);
    return;
  }
  const before = failures;
  const byKind = (kind) => objects.filter((o) => o.kind === kind);
  for (const obj of objects) {
    for (const e of await schemaErrors(obj)) {
      check(false, `${name}: ${obj.kind} ${obj.metadata?.name}: ${e}`);
    }
    checks += 1;
  }
  const namespaces = new Set(objects.filter((o) => !CLUSTER_SCOPED.has(o.kind))
    .map((o) => o.metadata.namespace));
  check(namespaces.size === 1 && Boolean([...namespaces][0]),
    `${name}: every object in one namespace (got ${[...namespaces]})`);
  const ns = byKind("Namespace");
  check(ns.length === 1 && ns[0].metadata.name === [...namespaces][0] &&
    ns[0].metadata.labels?.["pod-security.kubernetes.io/enforce"] === "restricted",
    `${name}: the Namespace enforces Pod Security "restricted"`);
  const runs = new Set(objects.map((o) => o.metadata.labels?.["interlock/run"]));
  check(runs.size === 1 && !runs.has(undefined), `${name}: every object labelled with one run`);
  for (const o of objects) {
    check(o.metadata.labels?.["app.kubernetes.io/part-of"] === "interlock",
      `${name}: ${o.kind} ${o.metadata.name}: label app.kubernetes.io/part-of`);
  }
  const workloads = objects.filter((o) => ["Deployment", "Job", "StatefulSet", "DaemonSet"].includes(o.kind));
  for (const w of workloads) {
    const labels = w.spec.template.metadata?.labels ?? {};
    check(labels["interlock/run"] === [...runs][0], `${name}: ${w.kind} ${w.metadata.name}: pods carry the run label`);
    checkPodSpec(`${name}: ${w.kind} ${w.metadata.name}`, w.spec.template, byKind);
  }
  const allWorkers = workloads.filter((o) => o.kind === "Deployment" &&
    o.spec.template.metadata.labels["app.kubernetes.io/component"] === "worker");
  const workers = allWorkers.filter((d) => !isExtra(d));
  const extras = allWorkers.filter(isExtra);
  const jobs = workloads.filter((o) => o.kind === "Job");
  const chain = checkWorkers(workers, byKind, extras);
  checkCoordinator(jobs, chain, byKind);
  if (extras.length) {
    checkExtras(extras, workers, jobs[0], byKind);
    if (jobs.length === 1) checkCoordinatorMembership(jobs[0], byKind);
  }
  checkNetwork(name, objects, workers, jobs[0], extras);
  checkMonitoring(byKind, workers, jobs[0], extras);
  checkDashboards(byKind);
  checkAutoscaling(byKind, workers, extras);
  check(byKind("ConfigMap").some((c) => Object.keys(c.data ?? {}).some((k) => k.endsWith(".pbtxt"))),
    `${name}: a run config ConfigMap`);
  console.log(`${failures === before ? "ok  " : "FAIL"} ${name}: ${objects.length} objects`);
}

// The dashboard files themselves: stable uid, a `datasource` variable that
// every panel and query uses (no __inputs), run and block variables, unique
// panel ids, panels that do not overlap.
function checkDashboardFiles() {
  for (const f of fs.readdirSync(DASHBOARDS).filter((n) => n.endsWith(".json"))) {
    const d = JSON.parse(fs.readFileSync(path.join(DASHBOARDS, f), "utf8"));
    const w = `dashboard ${f}`;
    check(/^[a-z0-9-]{1,40}$/.test(d.uid ?? ""), `${w}: stable uid`);
    check(!d.__inputs, `${w}: no __inputs (data source comes from a variable)`);
    const vars = Object.fromEntries((d.templating?.list ?? []).map((v) => [v.name, v]));
    check(vars.datasource?.type === "datasource" && vars.datasource?.query === "prometheus",
      `${w}: datasource variable of type prometheus`);
    for (const v of ["run", "block"]) {
      check(vars[v]?.type === "query" && vars[v]?.datasource?.uid === "${datasource}" &&
        /label_values\(/.test(vars[v]?.query?.query ?? ""), `${w}: ${v} variable`);
    }
    const panels = d.panels.flatMap((p) => [p, ...(p.panels ?? [])]);
    const ids = panels.map((p) => p.id);
    check(new Set(ids).size === ids.length, `${w}: unique panel ids`);
    const cells = new Set();
    for (const p of panels) {
      if (p.type !== "row") {
        check(p.datasource?.uid === "${datasource}", `${w}: panel '${p.title}' uses $datasource`);
        check((p.targets ?? []).length > 0 && p.targets.every((t) =>
          t.expr && t.datasource?.uid === "${datasource}"), `${w}: panel '${p.title}' queries`);
        check(/run=~"\$run"/.test(p.targets.map((t) => t.expr).join(" ")),
          `${w}: panel '${p.title}' is filtered by $run`);
      }
      const g = p.gridPos;
      let clash = g.x + g.w > 24 ? "beyond column 24" : "";
      for (let x = g.x; x < g.x + g.w; ++x) {
        for (let y = g.y; y < g.y + g.h; ++y) {
          if (cells.has(`${x},${y}`)) clash ||= `at ${x},${y}`;
          cells.add(`${x},${y}`);
        }
      }
      check(!clash, `${w}: panel '${p.title}' overlaps ${clash}`);
    }
  }
}

await checkValidatorRejects();
checkDashboardFiles();
const overlays = fs.readdirSync(OVERLAYS)
  .map((d) => path.join(OVERLAYS, d))
  .filter((d) => fs.existsSync(path.join(d, "kustomization.yaml")));
check(overlays.length > 0, `no overlays under ${OVERLAYS}`);
for (const dir of overlays) await checkOverlay(dir);
console.log(`${checks - failures} passed, ${failures} failed`);
process.exit(failures ? 1 : 0);
