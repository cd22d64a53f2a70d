#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>

#include "bindings.h"
#include "core/request_replay.h"
#include "pyengine/errors.h"
#include "pyengine/kv_cache_manager.h"
#include "token_ids.h"

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

template <typename T>
py::list to_list(std::span<const T> values) {
  py::list list(values.size());
  for (size_t i = 0; i < values.size(); ++i) list[i] = py::int_(values[i]);
  return list;
}

void bind_stats(py::module_& m) {
  py::class_<KVCacheStats>(m, "KVCacheStats")
      .def_readonly("num_blocks", &KVCacheStats::num_blocks)
      .def_readonly("num_used_blocks", &KVCacheStats::num_used_blocks)
      .def_readonly("num_free_blocks", &KVCacheStats::num_free_blocks)
      .def_readonly("num_cached_blocks", &KVCacheStats::num_cached_blocks)
      .def_readonly("usage", &KVCacheStats::usage)
      .def_readonly("prefix_cache_queries", &KVCacheStats::prefix_cache_queries)
      .def_readonly("prefix_cache_hits", &KVCacheStats::prefix_cache_hits)
      .def_readonly("num_evictions", &KVCacheStats::num_evictions)
      .def_readonly("internal_waste_tokens", &KVCacheStats::internal_waste_tokens)
      .def_readonly("num_host_blocks", &KVCacheStats::num_host_blocks)
      .def_readonly("num_host_used_blocks", &KVCacheStats::num_host_used_blocks)
      .def_readonly("num_host_cached_blocks", &KVCacheStats::num_host_cached_blocks)
      .def_readonly("host_cache_hits", &KVCacheStats::host_cache_hits)
      .def_readonly("num_blocks_offloaded", &KVCacheStats::num_blocks_offloaded)
      .def_readonly("num_blocks_swapped_out", &KVCacheStats::num_blocks_swapped_out)
      .def_readonly("num_swapped_requests", &KVCacheStats::num_swapped_requests)
      .def_property_readonly("prefix_cache_hit_rate",
                             [](const KVCacheStats& s) {
                               return s.prefix_cache_queries == 0
                                          ? 0.0
                                          : static_cast<double>(s.prefix_cache_hits) /
                                                static_cast<double>(s.prefix_cache_queries);
                             })
      .def("__repr__", [](const KVCacheStats& s) {
        std::ostringstream out;
        out << "KVCacheStats(num_blocks=" << s.num_blocks
            << ", num_used_blocks=" << s.num_used_blocks
            << ", num_free_blocks=" << s.num_free_blocks
            << ", num_cached_blocks=" << s.num_cached_blocks << ", usage=" << s.usage
            << ", prefix_cache_queries=" << s.prefix_cache_queries
            << ", prefix_cache_hits=" << s.prefix_cache_hits
            << ", num_evictions=" << s.num_evictions
            << ", internal_waste_tokens=" << s.internal_waste_tokens;
        if (s.num_host_blocks > 0) {
          out << ", num_host_blocks=" << s.num_host_blocks
              << ", num_host_used_blocks=" << s.num_host_used_blocks
              << ", num_host_cached_blocks=" << s.num_host_cached_blocks
              << ", host_cache_hits=" << s.host_cache_hits
              << ", num_blocks_offloaded=" << s.num_blocks_offloaded
              << ", num_blocks_swapped_out=" << s.num_blocks_swapped_out
              << ", num_swapped_requests=" << s.num_swapped_requests;
        }
        out << ")";
        return out.str();
      });
}

void bind_pool(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool", "Read-only view of a KVCacheManager's block pool.")
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def_property_readonly("num_cached_blocks", &BlockPool::num_cached_blocks)
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("num_filled", &BlockPool::num_filled, py::arg("block_id"))
      .def("is_cached", &BlockPool::is_cached, py::arg("block_id"))
      .def("is_free", &BlockPool::is_free, py::arg("block_id"))
      .def(
          "key",
          [](const BlockPool& p, BlockId b) {
            const BlockKey k = p.key(b);
            return py::make_tuple(k.hi, k.lo);
          },
          py::arg("block_id"), "(hi, lo) of a cached block's key; (0, 0) if not cached.")
      .def(
          "lookup",
          [](const BlockPool& p, uint64_t hi, uint64_t lo) {
            return p.lookup(BlockKey{hi, lo});
          },
          py::arg("hi"), py::arg("lo"), "The block cached under a key, or None.")
      .def(
          "stored_tokens",
          [](const BlockPool& p, BlockId b) { return to_list(p.stored_tokens(b)); },
          py::arg("block_id"))
      .def("free_blocks_in_order", &BlockPool::free_blocks_in_order,
           "Free block ids in the order allocation takes them.");
}

void bind_manager(py::module_& m) {
  m.def(
      "kv_max_blocks_held",
      [](const std::vector<std::pair<std::string, int>>& groups, int block_size,
         int64_t num_tokens, int64_t max_step_tokens) {
        check_argument(block_size > 0, "kv_max_blocks_held: block_size must be positive");
        return max_blocks_held(kv_groups(groups), block_size, num_tokens, max_step_tokens);
      },
      py::arg("kv_groups"), py::arg("block_size"), py::arg("num_tokens"),
      py::arg("max_step_tokens"),
      "The most blocks of all KV-cache groups one request holds at once (kv_group.h).");

  py::class_<GroupHit>(m, "GroupHit", "One KV-cache group's part of a prefix hit.")
      .def_readonly("first_block", &GroupHit::first_block)
      .def_readonly("block_ids", &GroupHit::block_ids)
      .def_readonly("host_block_ids", &GroupHit::host_block_ids);

  // (block_ids and host_block_ids: group 0's, the whole hit of a model of one group)
  const auto group0 = [](const ComputedBlocks& c) -> const GroupHit& {
    static const GroupHit none;
    return c.groups.empty() ? none : c.groups[0];
  };
  py::class_<ComputedBlocks>(m, "ComputedBlocks")
      .def_property_readonly("block_ids",
                             [group0](const ComputedBlocks& c) { return group0(c).block_ids; })
      .def_property_readonly(
          "host_block_ids", [group0](const ComputedBlocks& c) { return group0(c).host_block_ids; })
      .def_readonly("groups", &ComputedBlocks::groups)
      .def_readonly("num_computed_tokens", &ComputedBlocks::num_computed_tokens)
      .def_readonly("num_host_tokens", &ComputedBlocks::num_host_tokens)
      .def_readonly("state_checkpoint", &ComputedBlocks::state_checkpoint)
      .def("__repr__", [](const ComputedBlocks& c) {
        return "ComputedBlocks(num_groups=" + std::to_string(c.groups.size()) +
               ", num_computed_tokens=" + std::to_string(c.num_computed_tokens) + ")";
      });

  py::class_<KVCacheManager>(m, "KVCacheManager", R"doc(Paged KV-cache manager.

Per-request block tables over a pool of num_blocks blocks of block_size tokens, with
prefix caching (verified hits, LRU eviction), copy-on-write for forked requests and,
with num_host_blocks > 0, a host tier that evicted cached blocks and swapped-out
requests move to.)doc")
      .def(py::init([](int num_blocks, int block_size, bool enable_prefix_caching,
                       int num_host_blocks,
                       const std::vector<std::pair<std::string, int>>& groups,
                       int num_state_slots, int num_state_checkpoints,
                       int state_checkpoint_interval, bool state_snapshots) {
             return KVCacheManager(KVCacheConfig{
                 num_blocks, block_size, enable_prefix_caching, num_host_blocks,
                 kv_groups(groups), num_state_slots, num_state_checkpoints,
                 state_checkpoint_interval, state_snapshots});
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("enable_prefix_caching"),
           py::arg("num_host_blocks") = 0,
           py::arg("kv_groups") = std::vector<std::pair<std::string, int>>{},
           py::arg("num_state_slots") = 0, py::arg("num_state_checkpoints") = 0,
           py::arg("state_checkpoint_interval") = 1, py::arg("state_snapshots") = false,
           "kv_groups: (kind, size) per group, kind 'full' (size 0), 'sliding' (the window) "
           "or 'chunked' (the chunk); empty: one full group. num_state_slots > 0: each "
           "request holds a recurrent-state slot from its first allocation to its release; "
           "num_state_checkpoints > 0: prefix hits resume states from checkpoints, taken every "
           "state_checkpoint_interval blocks and at a prompt's last full block; state_snapshots: "
           "each slot has a snapshot slot for speculative decoding.")
      .def_property_readonly("num_groups", &KVCacheManager::num_groups)
      .def("max_blocks_held", &KVCacheManager::max_blocks_held, py::arg("num_tokens"),
           py::arg("max_step_tokens"))
      .def_property_readonly("num_blocks",
                             [](const KVCacheManager& k) { return k.config().num_blocks; })
      .def_property_readonly("block_size", &KVCacheManager::block_size)
      .def_property_readonly(
          "enable_prefix_caching",
          [](const KVCacheManager& k) { return k.config().enable_prefix_caching; })
      .def_property_readonly("num_free_blocks", &KVCacheManager::num_free_blocks)
      .def_property_readonly("num_requests", &KVCacheManager::num_requests)
      .def_property_readonly("pool", &KVCacheManager::pool,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("host_pool", &KVCacheManager::host_pool,
                             py::return_value_policy::reference_internal,
                             "The host tier's pool, or None without one.")
      .def("has_request", &KVCacheManager::has_request, py::arg("request_id"))
      .def(
          "add_request",
          [](KVCacheManager& k, const RequestId& id, const py::handle& prompt, int64_t adapter_id,
             std::string cache_salt) {
            const TokenIds tokens(prompt, "prompt_token_ids");
            k.add_request(id, tokens.span(), BlockExtras{adapter_id, std::move(cache_salt)});
          },
          py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("adapter_id") = 0,
          py::arg("cache_salt") = "")
      .def(
          "append_token_ids",
          [](KVCacheManager& k, const RequestId& id, const py::handle& token_ids) {
            const TokenIds tokens(token_ids, "token_ids");
            k.append_token_ids(id, tokens.span());
          },
          py::arg("request_id"), py::arg("token_ids"))
      .def("get_computed_blocks", &KVCacheManager::get_computed_blocks, py::arg("request_id"))
      .def("can_allocate_slots", &KVCacheManager::can_allocate_slots, py::arg("request_id"),
           py::arg("num_new_tokens"), py::arg("num_lookahead") = 0, py::arg("computed") = nullptr)
      .def(
          "allocate_slots",
          [](KVCacheManager& k, const RequestId& id, int num_new_tokens, int num_lookahead,
             const ComputedBlocks* computed) -> py::object {
            const auto new_blocks = k.allocate_slots(id, num_new_tokens, num_lookahead, computed);
            if (!new_blocks) return py::none();
            return to_list(*new_blocks);
          },
          py::arg("request_id"), py::arg("num_new_tokens"), py::arg("num_lookahead") = 0,
          py::arg("computed") = nullptr,
          "New block ids, or None (nothing changed) when too few blocks are free.")
      .def("free", &KVCacheManager::free, py::arg("request_id"))
      .def("rollback", &KVCacheManager::rollback, py::arg("request_id"),
           py::arg("num_computed_tokens"),
           "Takes back scheduled tokens from num_computed_tokens on (and their cache entries).")
      .def("fork", &KVCacheManager::fork, py::arg("parent_request_id"), py::arg("child_request_id"))
      .def("take_pending_copies", &KVCacheManager::take_pending_copies,
           "(src, dst) block copies that copy-on-write queued since the last call.")
      .def("state_slot",
           py::overload_cast<const RequestId&>(&KVCacheManager::state_slot, py::const_),
           py::arg("request_id"),
           "The request's recurrent-state slot (-1: not allocated yet, or no states kept).")
      .def_property_readonly("num_free_state_slots", &KVCacheManager::num_free_state_slots)
      .def("take_pending_state_copies", &KVCacheManager::take_pending_state_copies,
           "(src, dst) state-slot copies that fork and checkpoint saves queued since the last "
           "call, to run after the step.")
      .def("take_pending_state_loads", &KVCacheManager::take_pending_state_loads,
           "(checkpoint, slot) copies that prefix hits queued, to run before the step.")
      .def_property_readonly("num_state_checkpoints_held",
                             &KVCacheManager::num_state_checkpoints_held)
      .def("reset_prefix_cache", &KVCacheManager::reset_prefix_cache)
      .def("can_swap_out", &KVCacheManager::can_swap_out, py::arg("request_id"))
      .def("swap_out", &KVCacheManager::swap_out, py::arg("request_id"),
           "Copies a request's blocks to the host tier and frees its device blocks; its "
           "next allocate_slots copies them back.")
      .def("is_swapped", &KVCacheManager::is_swapped, py::arg("request_id"))
      .def(
          "take_pending_transfers",
          [](KVCacheManager& k) {
            KVTransfers t = k.take_pending_transfers();
            return py::make_tuple(std::move(t.to_host), std::move(t.to_device));
          },
          "(to_host, to_device): the (src, dst) copies between the tiers queued since the "
          "last call, to run in that order.")
      .def(
          "block_table",
          [](const KVCacheManager& k, const RequestId& id, int group) {
            return to_list(k.block_table(id, group));
          },
          py::arg("request_id"), py::arg("group") = 0,
          "A group's block table; -1 where a window released a block.")
      .def(
          "token_ids",
          [](const KVCacheManager& k, const RequestId& id) { return to_list(k.token_ids(id)); },
          py::arg("request_id"))
      .def("num_computed_tokens", &KVCacheManager::num_computed_tokens, py::arg("request_id"))
      .def("stats", &KVCacheManager::stats);
}

// Splits flat token ids at start_loc ([num_requests + 1], start_loc[0] == 0, ascending,
// ending at the total) into one span per request.
std::vector<std::span<const TokenId>> split_ragged(std::span<const TokenId> flat,
                                                   const py::handle& start_loc, const char* name) {
  const auto loc = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(
      py::module_::import("numpy").attr("asarray")(start_loc));
  if (!loc || loc.ndim() != 1 || loc.size() < 1 || loc.data()[0] != 0 ||
      loc.data()[loc.size() - 1] != static_cast<int64_t>(flat.size())) {
    throw py::value_error(std::string(name) +
                          " must be 1-D, start at 0 and end at the number of token ids");
  }
  std::vector<std::span<const TokenId>> parts;
  parts.reserve(static_cast<size_t>(loc.size() - 1));
  for (py::ssize_t i = 0; i + 1 < loc.size(); ++i) {
    const int64_t begin = loc.data()[i];
    const int64_t end = loc.data()[i + 1];
    if (end < begin) throw py::value_error(std::string(name) + " must be non-decreasing");
    parts.push_back(flat.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin)));
  }
  return parts;
}

void bind_replay(py::module_& m) {
  m.def(
      "replay_requests",
      [](KVCacheManager& kv, const py::handle& prompt_token_ids, const py::handle& prompt_start_loc,
         const py::handle& decode_token_ids, const py::handle& decode_start_loc,
         int max_live_requests) {
        const TokenIds prompt_tokens(prompt_token_ids, "prompt_token_ids");
        const TokenIds decode_tokens(decode_token_ids, "decode_token_ids");
        const auto prompts =
            split_ragged(prompt_tokens.span(), prompt_start_loc, "prompt_start_loc");
        const auto decodes =
            split_ragged(decode_tokens.span(), decode_start_loc, "decode_start_loc");
        if (prompts.size() != decodes.size()) {
          throw py::value_error("replay_requests: prompts and decodes differ in number");
        }
        std::vector<ReplayRequest> requests;
        requests.reserve(prompts.size());
        for (size_t i = 0; i < prompts.size(); ++i) requests.push_back({prompts[i], decodes[i]});
        // The GIL stays held: other Python threads must not use `kv` meanwhile.
        const ReplayStats stats = replay_requests(kv, requests, max_live_requests);
        py::dict result;
        result["num_ops"] = stats.num_ops;
        result["num_hit_tokens"] = stats.num_hit_tokens;
        result["num_preemptions"] = stats.num_preemptions;
        return result;
      },
      py::arg("manager"), py::arg("prompt_token_ids"), py::arg("prompt_start_loc"),
      py::arg("decode_token_ids"), py::arg("decode_start_loc"), py::arg("max_live_requests"),
      R"doc(Replays requests through `manager` natively, without a model.

Request i (id "req-<i>") has the prompt prompt_token_ids[prompt_start_loc[i]:
prompt_start_loc[i + 1]] and decodes decode_token_ids[decode_start_loc[i]:
decode_start_loc[i + 1]], one token per step: the flat layout of vLLM's
query_start_loc, so a whole trace crosses the binding in four arrays. It is added,
takes its prefix hit, computes the rest of its prompt, then decodes. At most
max_live_requests stay live (oldest freed first); when blocks run out the oldest
live request is preempted. Returns {"num_ops", "num_hit_tokens", "num_preemptions"}.)doc");
}

}  // namespace

void bind_kv_cache(py::module_& m) {
  bind_stats(m);
  bind_pool(m);
  bind_manager(m);
  bind_replay(m);
}

}  // namespace pyengine::bindings
