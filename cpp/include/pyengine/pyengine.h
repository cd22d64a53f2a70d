// pyengine's public C++ API in one include: the memory manager (block pool, prefix
// hash, KV-cache manager), the scheduler and its step buffers, and the kernels that run
// on tensor views (paged attention and the cache write, cache copies, fused layers, the
// small-batch matmul). Link pyengine::core (find_package(pyengine)); no Python, no torch.
#pragma once

#include "pyengine/attention.h"
#include "pyengine/block_index.h"
#include "pyengine/block_pool.h"
#include "pyengine/cache_ops.h"
#include "pyengine/dense.h"
#include "pyengine/errors.h"
#include "pyengine/kv_cache_manager.h"
#include "pyengine/layer_ops.h"
#include "pyengine/draft_budget.h"
#include "pyengine/ngram_proposer.h"
#include "pyengine/prefix_hash.h"
#include "pyengine/request.h"
#include "pyengine/scheduler.h"
#include "pyengine/scheduler_output.h"
#include "pyengine/suffix_proposer.h"
#include "pyengine/suffix_tree.h"
#include "pyengine/tensor_view.h"
#include "pyengine/version.h"
