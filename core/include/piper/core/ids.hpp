// Strong integer ids used across module boundaries (devices, DAG nodes, streams, ...).
#pragma once

#include <compare>
#include <cstdint>
#include <functional>

namespace piper::core {

template <class Tag>
struct StrongId {
  std::int32_t value = -1;
  constexpr StrongId() = default;
  constexpr explicit StrongId(std::int32_t v) : value(v) {}
  constexpr bool valid() const { return value >= 0; }
  friend constexpr auto operator<=>(StrongId, StrongId) = default;
};

using DeviceId = StrongId<struct DeviceTag>;
using NodeId = StrongId<struct NodeTag>;

}  // namespace piper::core

template <class Tag>
struct std::hash<piper::core::StrongId<Tag>> {
  std::size_t operator()(piper::core::StrongId<Tag> id) const noexcept { return std::hash<std::int32_t>{}(id.value); }
};
