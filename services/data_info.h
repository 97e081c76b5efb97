// What an exported network needs to know of the data it was trained on:
// how the loader turned raw inputs into the tensors the model saw, and the
// names of the classes. Kept apart from data.h, which most of the code
// includes, since only exports need it.
#ifndef INTERLOCK_SERVICES_DATA_INFO_H_
#define INTERLOCK_SERVICES_DATA_INFO_H_

#include <string>
#include <vector>

#include "proto/config.pb.h"

namespace interlock {

struct DataInfo {
  // Images stored as bytes: x / 255, then (x - mean[c]) / std[c] per
  // channel. Empty: inputs are used as stored.
  std::vector<double> mean;
  std::vector<double> std;
  // Class names in label order (empty: the data set names none).
  std::vector<std::string> class_names;
};

DataInfo DataInfoOf(const interlock::v1::DataSpec& spec);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DATA_INFO_H_
