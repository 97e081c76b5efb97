// Hostile clients against a real interlock-worker process on loopback:
// Stream takeover, memory growth and stuck state transfers
// (docs/RELIABILITY.md, "Attacks and mistakes").
#include <gtest/gtest.h>

#include "tests/cluster_util.h"
