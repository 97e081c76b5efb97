// A careless operator starting interlock-worker: bad flags, an occupied
// port, an unauthenticated metrics port (docs/RELIABILITY.md, "Attacks and
// mistakes").
#include <gtest/gtest.h>

#include "tests/cluster_util.h"
