// The plan kinds: column 0 of every dsa_plan row (docs/ops.md §2.4). The one Python definition is
// custom_ops/plan_kind.py (PlanKind); tests/ops/test_plan_kind.py checks that these values are its values.
#pragma once

#include <cstdint>

namespace offload_plan_kind {

enum Kind : int32_t {
  kInvalid = 0,
  kPoolHit = 1,
  kFullOldMiss = 2,
  kDecodeWindow = 3,
  kFutureSkip = 4,
  kNegativeStop = 5,
};

}  // namespace offload_plan_kind
