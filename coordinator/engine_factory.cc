#include "coordinator/engine_factory.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "coordinator/cluster_engine.h"
#include "coordinator/inprocess_engine.h"
#include "plan/status_macros.h"
#include "plan/topology.h"
#include "rpc/channel.h"
#include "services/config.h"
#include "services/device.h"
#include "services/logging.h"
#include "services/models.h"

namespace interlock {

RunEngine::~RunEngine() {
  if (engine_) engine_->Shutdown();
  // No Register or Leave reaches the membership once the server is gone.
  coordinator_.reset();
  if (local_) {
    if (on_cluster_) on_cluster_(nullptr);
    local_->Stop();
  }
}

absl::StatusOr<std::unique_ptr<RunEngine>> MakeEngine(
    const ResolvedRun& resolved, const DataShape& shape,
    const EngineOptions& options, int window, CoordinatorMetrics* metrics) {
  std::unique_ptr<RunEngine> run(new RunEngine());
  const v1::RunConfig& config = resolved.config;
  const int k = resolved.blocks;
  if (options.kind == EngineKind::kInProcess) {
    ASSIGN_OR_RETURN(run->engine_,
                     MakeInProcessEngine(resolved, shape, options.schedule));
    return run;
  }
  const std::vector<int>& replicas = resolved.replicas;
  const std::vector<c10::Device>& devices = resolved.devices;
  ClusterOptions co;
  co.workers = options.workers;
  co.collective_host = options.collective_host;
  if (co.collective_host.empty()) {
    // Where the workers can reach this process: loopback when they all
    // live on this machine's loopback, else its host name.
    bool remote = false;
    for (const auto& block : options.workers) {
      for (const auto& a : block) {
        const size_t colon = a.rfind(':');
        remote |= !IsLoopbackHost(Unbracketed(
            a.substr(0, colon == std::string::npos ? a.size() : colon)));
      }
    }
    char name[256] = {0};
    if (remote && gethostname(name, sizeof(name) - 1) == 0) {
      co.collective_host = name;
    } else {
      co.collective_host = "127.0.0.1";
    }
  }
  co.collective_port = options.collective_port;
  co.keep_snapshots = options.keep_snapshots;
  co.on_generation = options.on_generation;
  co.adopt = options.adopt;
  co.connect_timeout = options.connect_timeout;
  co.window = window;
  ASSIGN_OR_RETURN(co.security, LoadTransportSecurity(options.security,
                                                      /*server=*/false));
  // Checkpoints are sealed with the user's token only: a local cluster's
  // generated token (below) changes with every start, so a resumed run could
  // not verify them.
  run->seal_key_ = co.security.token;
  if (metrics) {
    co.on_worker_state = [metrics](int block, bool up) {
      metrics->SetWorkerUp(block, up);
    };
  }
  if (co.workers.empty()) {
    // Each worker runs its block where --device says (the workers' default,
    // the CPU, when it is not given).
    // One process per replica, block after block.
    std::vector<std::vector<std::string>> worker_flags;
    int count = 0;
    for (int b = 0; b < k; ++b) {
      for (int r = 0; r < replicas[b]; ++r, ++count) {
        std::vector<std::string> flags;
        if (!options.devices.empty()) {
          flags.push_back("--device=" + devices[b].str());
        }
        worker_flags.push_back(std::move(flags));
      }
    }
    std::vector<std::string> extra = SecurityFlags(options.security);
    if (Replicated(replicas)) extra.push_back("--collective_host=127.0.0.1");
    // The workers log in as much detail as this process.
    if (FLAGS_v > 0) extra.push_back(absl::StrCat("--verbosity=", FLAGS_v));
    // Without the user's token or TLS the workers still require a token:
    // one generated for this cluster, which other local users cannot read.
    const bool generate_token = options.security.empty();
    ASSIGN_OR_RETURN(run->local_,
                     LocalCluster::Launch(count,
                                          options.worker_binary.empty()
                                              ? DefaultWorkerBinary()
                                              : options.worker_binary,
                                          absl::Seconds(120), extra,
                                          worker_flags, generate_token));
    if (generate_token) {
      co.security.token = run->local_->token();
      if (options.coordinator_port >= 0) {
        LOG(INFO) << "the local cluster's workers require the token in "
                  << run->local_->token_file()
                  << "; a worker joining through the membership service passes "
                     "--token_file "
                  << run->local_->token_file();
      }
    }
    run->on_cluster_ = options.on_cluster;
    if (run->on_cluster_) run->on_cluster_(run->local_.get());
    const std::vector<std::string> addresses = run->local_->addresses();
    size_t next = 0;
    for (int b = 0; b < k; ++b) {
      co.workers.emplace_back(addresses.begin() + next,
                              addresses.begin() + next + replicas[b]);
      next += replicas[b];
    }
    // Like a restartPolicy: a dead worker is started again on its port.
    co.revive = [l = run->local_.get()] {
      auto n = l->ReviveDead();
      if (!n.ok()) {
        LOG(WARNING) << "restarting workers: " << n.status();
      } else if (*n > 0) {
        LOG(INFO) << "restarted " << *n << " worker(s)";
      }
    };
  }
  // The membership service and the rendezvous store answer with the
  // run's token; a local cluster's ask for the token its workers have:
  // neither tells anyone else the run's id, nor lets them write its keys.
  ASSIGN_OR_RETURN(co.server_security,
                   LoadTransportSecurity(options.security, /*server=*/true));
  if (run->local_ && co.server_security.token.empty()) {
    co.server_security.token = co.security.token;
  }
  if ((Replicated(replicas) || options.coordinator_port >= 0) &&
      !options.insecure && !IsLoopbackHost(co.collective_host) &&
      co.server_security.token.empty() && co.server_security.ca_pem.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--collective-host ", co.collective_host,
        " is not a loopback address and the run has no --token-file or "
        "mutual TLS: anyone who reaches the replicas' rendezvous store could "
        "read and write its keys; give it --token-file (or --tls-cert, "
        "--tls-key and --tls-ca), or pass --insecure on a network you trust"));
  }
  if (options.coordinator_port >= 0) {
    run->membership_ = std::make_unique<Membership>(
        k, config.training().microbatches(), ModelFingerprint(config));
    if (metrics) {
      run->membership_->set_on_refused(
          [metrics](const std::string& reason) { metrics->OnRefused(reason); });
    }
    ASSIGN_OR_RETURN(
        run->coordinator_,
        CoordinatorServer::Start(options.coordinator_host,
                                 options.coordinator_port, co.server_security,
                                 co.security, run->membership_.get()));
    LOG(INFO) << "membership service on " << options.coordinator_host << ":"
              << run->coordinator_->port()
              << (options.insecure ? " (--insecure)" : "");
    if (!options.coordinator_port_file.empty()) {
      const std::string tmp = options.coordinator_port_file + ".tmp";
      {
        std::ofstream out(tmp);
        out << run->coordinator_->port() << "\n";
      }
      std::rename(tmp.c_str(), options.coordinator_port_file.c_str());
    }
    co.membership = run->membership_.get();
  }
  if (metrics) {
    co.on_topology = [metrics](const TopologyEvent& e) {
      metrics->OnTopology(e);
    };
  }
  co.on_join_dropped = [](const MemberChange& c, const absl::Status& why) {
    LOG(WARNING) << c.address << " registered for block " << c.block
                 << " but is gone at the step boundary; not joined ("
                 << why.message() << ")";
  };
  ASSIGN_OR_RETURN(run->engine_, MakeClusterEngine(resolved, shape, co));
  return run;
}

}  // namespace interlock
