// The block host: tasks run in the order posted, on its own thread or on a
// queue shared by several hosts, and a stop drains or abandons what waits.
#include "services/block_host.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace interlock {
namespace {

TEST(BlockHost, RunsTasksInOrderOnItsOwnThread) {
  BlockHost host(BlockHost::Options{});
  std::vector<int> seen;
  std::thread::id executor;
  for (int i = 0; i < 100; ++i) {
    host.Post([&, i] {
      if (i == 0) executor = std::this_thread::get_id();
      EXPECT_EQ(std::this_thread::get_id(), executor);
      seen.push_back(i);
    });
  }
  std::vector<int> copy;
  host.Call([&] { copy = seen; });  // runs after everything posted before
  ASSERT_EQ(copy.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(copy[i], i);
  EXPECT_NE(executor, std::this_thread::get_id());
}

TEST(BlockHost, StopDrainsOrAbandonsWhatWaits) {
  for (auto mode :
       {BlockHost::StopMode::kDrain, BlockHost::StopMode::kAbandon}) {
    BlockHost host(BlockHost::Options{});
    std::mutex gate;
    gate.lock();
    std::atomic<int> ran{0};
    std::atomic<bool> started{false};
    host.Post([&] {
      started = true;
      std::lock_guard<std::mutex> l(gate);  // holds the executor
      ++ran;
    });
    for (int i = 0; i < 5; ++i) host.Post([&] { ++ran; });
    while (!started) std::this_thread::yield();
    std::thread stopper([&] { host.Stop(mode); });
    // Let the stop be seen before the first task finishes.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.unlock();
    stopper.join();
    EXPECT_EQ(ran.load(), mode == BlockHost::StopMode::kDrain ? 6 : 1);
    EXPECT_FALSE(host.Post([&] { ++ran; }));
    int here = 0;
    host.Call([&] { ++here; });  // stopped: runs on the caller
    EXPECT_EQ(here, 1);
  }
}

// Hosts sharing a queue run all their tasks on the caller's thread, in the
// order posted across hosts, tasks posted by tasks included.
TEST(BlockHost, SharedQueueKeepsTheGlobalOrder) {
  BlockHost::SharedQueue queue;
  BlockHost::Options options;
  options.shared = &queue;
  BlockHost a(options), b(options);
  std::vector<std::string> seen;
  a.Post([&] {
    seen.push_back("a1");
    b.Post([&] { seen.push_back("b2"); });
  });
  b.Post([&] {
    seen.push_back("b1");
    a.Post([&] { seen.push_back("a2"); });
  });
  EXPECT_TRUE(seen.empty());
  queue.RunPending();
  EXPECT_EQ(seen, (std::vector<std::string>{"a1", "b1", "b2", "a2"}));
}

}  // namespace
}  // namespace interlock
