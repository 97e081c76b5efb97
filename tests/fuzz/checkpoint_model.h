// The model whose block 0 the checkpoint-reader fuzz target loads states
// into, and whose saved states fuzz_seeds writes as that target's seeds:
// one definition, so the seeds keep loading when either side changes.
#ifndef INTERLOCK_TESTS_FUZZ_CHECKPOINT_MODEL_H_
#define INTERLOCK_TESTS_FUZZ_CHECKPOINT_MODEL_H_

#include "services/data.h"

namespace interlock::fuzz {

inline constexpr char kCheckpointModel[] = R"pb(
  model {
    resnet { architecture: "8,1/16,1" }
    partition: "1,rest"
    head: "gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
    synthetic_classes: 4
  }
  optimizer { kind: ADAM }
  training { mode: INTERLOCK n: 2 batch_size: 4 microbatches: 2 }
)pb";

// The data shape of kCheckpointModel (3x8x8 images, 4 classes).
inline DataShape CheckpointModelShape() {
  DataShape shape;
  shape.channels = 3;
  shape.height = 8;
  shape.width = 8;
  shape.classes = 4;
  return shape;
}

}  // namespace interlock::fuzz

#endif  // INTERLOCK_TESTS_FUZZ_CHECKPOINT_MODEL_H_
