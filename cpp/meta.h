// Token metadata (the AMoE paper's Table 1) and the fixed wire layout of a message's metadata.
// Plain C++: no torch here, so files that only need metadata (the scheduler) compile fast.
#pragma once

#include <cstdint>
#include <functional>
#include <type_traits>

namespace amoe {

enum LayerKind : int32_t { kAttn = 0, kExpert = 1 };

// LayerID = (kind, block, index): ATTN with index = attention DP rank and block in [0, num_blocks]
// (block == num_blocks is the head + sampler); EXPERT with index = expert id, block in [0, num_blocks).
struct LayerId {
  int32_t kind;
  int32_t block;
  int32_t index;

  bool operator==(const LayerId& o) const { return kind == o.kind && block == o.block && index == o.index; }
  bool operator!=(const LayerId& o) const { return !(*this == o); }
};

// One row (token part) of a message. Slot 0 is the residual (or, at ATTN block 0, the token id); slots
// 1..K are the token's K expert choices, in router order. Expert rows carry the slot their output will
// fill at the next attention layer.
struct RowMeta {
  uint64_t request_id;
  LayerId layer;        // where this row goes next
  int32_t position;     // token position in its request
  int32_t chunk_start;  // first position of the chunk (prefill or decode step) this row belongs to
  int32_t chunk_len;    // rows in that chunk (1 for a decode step)
  int32_t slot;         // 0 = residual / token id, 1..K = expert choice
  int32_t expert_id;    // the expert of this slot (-1 for slot 0)
  float weight;         // top-k weight of this slot (0 for slot 0)
  int32_t attn_rank;    // attention DP rank that holds the request
  // Under `waves`: the request's wave on its attention rank (-1: none), which the expert side groups by
  // (docs/scheduler.md "Group cells"). Set by the attention runtime; carried back unread.
  int32_t wave = -1;
  int32_t reserved = 0;  // explicit padding: every byte on the wire is defined
};

// Metadata travels as a header followed by num_rows RowMeta, memcpy-able as they are (little endian).
// The tensor plane carries data: [num_rows, hidden] of dtype, or int64 [num_rows] token ids.
constexpr uint32_t kMessageMagic = 0x454f4d41;  // "AMOE"
constexpr uint16_t kMessageVersion = 2;         // 2: RowMeta::wave

struct MessageHeader {
  uint32_t magic = kMessageMagic;
  uint16_t version = kMessageVersion;
  uint16_t row_size = sizeof(RowMeta);
  int32_t src_runtime = -1;
  int32_t dtype = 0;  // c10::ScalarType of the data tensor
  int64_t num_rows = 0;
  int64_t hidden = 0;  // 0 for token ids
};

static_assert(std::is_trivially_copyable<RowMeta>::value, "RowMeta must be memcpy-able");
static_assert(sizeof(LayerId) == 12, "LayerId layout is part of the wire format");
static_assert(sizeof(RowMeta) == 56, "RowMeta layout is part of the wire format");
static_assert(sizeof(MessageHeader) == 32, "MessageHeader layout is part of the wire format");

// The communicator's envelope (cpp/zmq_comm.h): first bytes of the first ZeroMQ frame of every transfer.
// Frame 0 = TransferHeader [+ MessageHeader + num_rows RowMeta]; an inline transfer adds frame 1 = the tensor
// bytes; a two-phase transfer moves them over the tensor plane, matched by (src, tag).
constexpr uint32_t kTransferMagic = 0x58544d41;  // "AMTX"
constexpr uint16_t kTransferVersion = 1;

enum TransferKind : uint8_t {
  kInlineTransfer = 0,    // payload in frame 1
  kTwoPhaseTransfer = 1,  // payload on the tensor plane
  kHelloTransfer = 2,     // a peer connected (no message)
  kByeTransfer = 3,       // a peer is closing in order (no message)
};

struct TransferHeader {
  uint32_t magic = kTransferMagic;
  uint16_t version = kTransferVersion;
  uint8_t kind = kInlineTransfer;
  uint8_t generation = 0;  // the sender process's generation mod 256 (0 first, +1 per replacement)
  int32_t src = -1;        // sender's rank; equals MessageHeader::src_runtime
  uint32_t tag = 0;        // tensor-plane tag of a two-phase transfer (seq mod 2^31)
  uint64_t seq = 0;        // per (sender, receiver) sequence number
  uint64_t nbytes = 0;     // payload bytes
};

static_assert(std::is_trivially_copyable<TransferHeader>::value, "TransferHeader must be memcpy-able");
static_assert(sizeof(TransferHeader) == 32, "TransferHeader layout is part of the wire format");

struct LayerIdHash {
  size_t operator()(const LayerId& l) const {
    return (static_cast<size_t>(l.kind) << 60) ^ (static_cast<size_t>(l.block) << 32) ^
           static_cast<size_t>(static_cast<uint32_t>(l.index));
  }
};

}  // namespace amoe
