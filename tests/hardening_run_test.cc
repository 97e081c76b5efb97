// A careless operator running `interlock train`: bad values, a full or
// shared --out, overflowing schedules, altered checkpoints, stale folders
// (docs/RELIABILITY.md, "Attacks and mistakes").
#include <gtest/gtest.h>
