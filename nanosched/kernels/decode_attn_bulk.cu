// Paged GQA decode attention for a few SMs (Hopper, sm_90): bulk copies into a shared-memory
// ring, tensor-core products. Built at run time through cupy (NVRTC) by decode_attn_bulk.py,
// which defines HKV, GROUP, HEAD_DIM, SLOTS, SLOT_BOXES and F16 (0: bf16, 1: fp16).
//
// Contract (that of reference.decode_attention): q [n, HKV*GROUP, HEAD_DIM]; K and V caches
// [P, PAGE, HKV, HEAD_DIM], each page contiguous; block table [n, bt_cols] int32 (row stride
// bt_stride); context lengths [n] int32. A work item is (request, split): `pages_per_split`
// consecutive pages of one request, all KV heads. The grid is persistent (`gridDim.x` CTAs, one
// per SM: the ring takes most of its shared memory; or MIN_BLOCKS per SM, each with its share
// of the SM's, as an FP8 cache on a few SMs runs), each CTA taking items blockIdx.x,
// blockIdx.x + gridDim.x, ...
//
// The ring: SLOTS slots of SLOT_BOXES boxes, a box being one tensor copy of 64 dims x 16 tokens
// x HKV heads of K or V (16 KB for 8 heads). A page is 2 * HEAD_DIM / 64 boxes, its K's then its
// V's, and the boxes of page after page fill slot after slot, round the ring. Each slot has a
// `full` mbarrier (its bytes landed) and an `empty` one (the HKV consumer warps are done with it).
// With a page's K (or V) per slot, the wrapper's default (6 x 32 KB for 8 KV heads of 128 dims),
// the consumers give K back after S and V after P.V, so while they work on one page the copies
// in flight fill the ring but for one slot: 160-192 KB per SM, where whole-page slots would keep
// 128 KB (Little's law: a few SMs must each pull 100-190 GB/s at a microsecond or so of latency).
//
// Roles: the last warp is the producer. One lane issues the tensor copies of each slot through the
// tensor maps the wrapper built, completing on the slot's `full` mbarrier, as soon as the slot is
// empty: it runs a whole ring ahead of the consumers, across item boundaries. The block-table
// ids of each chunk of 32 pages (one per lane) and its item's context length are loaded while
// the previous chunk is issued, so the producer does not stall on those loads. The maps order the
// dims (d, token, head, page), so a box lands as [head][token][64 dims] rows of 128 B under the
// 128-byte swizzle: the 8 token rows an ldmatrix 8x8 reads for one head fall in 8 different bank
// groups (in the cache's own [token][head][d] order they would all share one). Few large copies
// matter: one 2 KB bulk copy per token row held a CTA to ~34 B/cycle. Warps 0..HKV-1 are
// consumers, warp h owning KV head h and its GROUP query heads:
//   S^T = K_h Q_h^T   one mma m16n8k16 per 16 dims: M = the page's 16 tokens, N = 8 query heads
//                      (GROUP of them real), A = K from shared memory (ldmatrix), B = Q in
//                      registers for the whole item;
//   online softmax    per query head, in the log2 domain, across the 8 lanes of a head column;
//   O^T += V_h^T P^T  one mma per 16 dims: A = V^T (ldmatrix.trans), B = P^T moved from the
//                      S^T accumulator layout by four shuffles.
// A consumer warp waits on a slot's `full` mbarrier before reading its first box and gives the
// slot back with one arrive on its `empty` mbarrier after the ldmatrix of its last box. Producer
// and consumers walk the ring with the same position (slot, parity of its use), carried across
// items, so their phases agree whatever the pages per item; the producer's first pass waits on
// parity 1, which a fresh mbarrier passes. A wait names only the parity of a use, so no
// consumer may skip a slot's use: one that did could find the slot two uses on and wait on the
// wrong phase (two consumer warps per head taking alternate pages of one ring fail that way).
// O is rescaled only when some query head's running max moved. A partial
// last page is copied whole: its scores past the context are masked to -inf, and its rows there
// hold earlier K/V of the cache (finite: the cache is zeroed when allocated), weighted by 0.
//
// An FP8 cache (KV_FP8 = 1: e4m3 K and V, one fp32 scale per (token, KV head) in `ks`, `vs`
// [P, PAGE, HKV], each page's block contiguous): a box is 128 dims (128 B rows, the same
// swizzle) and a slot holds a page's K (or V) and, after its boxes, the page's 512 B of scales,
// copied with one bulk copy completing on the same mbarrier. The products run in fp16: e4m3
// converts to f16 two values an instruction (`cvt.rn.f16x2.e4m3x2`, of either half of a word);
// q is converted once per item. (An e4m3 `mma.sync` m16n8k32 is no faster on sm_90: ptxas
// lowers it to the same conversions and two f16 mmas; Hopper's FP8 tensor path is wgmma.) One
// ldmatrix.x4 gives a lane four 32-bit words of two 16-dim steps, each byte pair one b16:
//   K as A of S^T      a word holds dims 4c..4c+3 of token g (or g+8): the mma's k slots
//                      (2c, 2c+1 | 2c+8, 2c+9) of lane (g, c) take dims (4c, 4c+1 | 4c+2, 4c+3)
//                      (the sum over k does not care which dim sits in which slot, so Q's B
//                      fragment is loaded in the same order);
//   V^T as A of O^T    (.trans) a word holds dims 2g, 2g+1 of tokens 2c, 2c+1 (or 2c+8, 2c+9):
//                      rows g and g+8 of an m-tile are dims 2g and 2g+1 (the output is written
//                      in that order), each taking its dim's two tokens after a byte permute;
//   scales             a token's K scale multiplies its row of S^T before the softmax; its V
//                      scale multiplies its probabilities after the row sums and before P.V.
// The conversions keep the integer pipe the busiest of an SM (Nsight Compute, 16 H100 SMs:
// 56% of its peak with one warp per head); bit moves in their place (sign and the 7 other bits
// of a byte at the top of an f16 half is the value x 2^-8) cost more of it, not less.

// Output: one split per request writes the normalised result to `out` in the model dtype;
// several write fp32 partials `part` [n, Hq, splits, HEAD_DIM] and their log-sum-exp `lse`
// [n, Hq, splits] (natural log), which the Triton merge kernel of decode_attn.py combines.
// An item with no tokens (a padded row) writes zeros and lse = -inf.
//
// CONSUME_ONLY = 1 builds a diagnostic, not an attention: its consumers wait for each slot and
// give it back without reading it, so its time is what the producer and the ring alone allow
// (bench/kernels_decode_attn.py --kernels cuda_bulk_consume); it writes zeros.

#ifndef HKV
#define HKV 8
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef SLOTS
#define SLOTS 6
#endif
#ifndef SLOT_BOXES
#define SLOT_BOXES (HEAD_DIM / 64)
#endif
#ifndef F16
#define F16 0
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // CTAs sharing an SM (the wrapper's ctas_per_sm): registers for each
#endif
#ifndef CONSUME_ONLY
#define CONSUME_ONLY 0  // 1: a diagnostic whose consumers only take and give back slots
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define PAGE 16
#define HQ (HKV * GROUP)
#if KV_FP8
#define BOX_DIMS 128  // 128 B rows of 1-byte elements
#define SCALE_BYTES (PAGE * HKV * 4)  // a page's fp32 scales of K (or of V)
#else
#define BOX_DIMS 64   // 128 B rows of 2-byte elements
#define SCALE_BYTES 0
#endif
#define BOX_BYTES (128 * PAGE * HKV)     // one tensor copy: BOX_DIMS dims of every token and head
#define BOXES (HEAD_DIM / BOX_DIMS)      // boxes of a page's K (and of its V)
#define STEPS_PER_BOX (BOX_DIMS / 16)    // 16-dim mma steps in a box
// a slot: its boxes (and, FP8, the page's scales after them), 1024-byte aligned for the swizzle
#define SLOT_BYTES ((SLOT_BOXES * BOX_BYTES + SCALE_BYTES + 1023) / 1024 * 1024)
#define RING_BYTES (SLOTS * SLOT_BYTES)
#define THREADS ((HKV + 1) * 32)
#define KSTEPS (HEAD_DIM / 16)
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

static_assert(GROUP >= 1 && GROUP <= 8, "a KV head's query heads fill at most the mma's N = 8");
static_assert(HEAD_DIM % BOX_DIMS == 0, "head_dim must fill whole 128-byte box rows");
static_assert(!KV_FP8 || SLOT_BOXES == BOXES, "an FP8 slot holds a page's K (or V) and scales");
static_assert(HKV >= 1 && HKV <= 16, "one consumer warp per KV head");
static_assert(SLOTS >= 1 && SLOT_BOXES >= 1 && (2 * BOXES) % SLOT_BOXES == 0,
              "a slot holds a whole number of boxes, and a page a whole number of slots");

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// one box of a 4-D tensor map (dims d, token, head, page) at coordinates c0..c3 into `dst`
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* map, int c0, int c1, int c2,
                                            int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3, %4, %5}], [%6];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// `bytes` (a multiple of 16) from global `src` into shared `dst`, completing on `bar`
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ float ldsf(u32 addr) {
  float r;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(r) : "r"(addr));
  return r;
}

// two e4m3 (the low half of x, low byte first) -> f16x2 (low half first)
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 x) {
  u32 r;
  asm("{.reg .b16 lo, hi;\n"
      "mov.b32 {lo, hi}, %1;\n"
      "cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ u32 e4m3x2_hi_to_f16x2(u32 x) {  // of the high half of x
  u32 r;
  asm("{.reg .b16 lo, hi;\n"
      "mov.b32 {lo, hi}, %1;\n"
      "cvt.rn.f16x2.e4m3x2 %0, hi;}" : "=r"(r) : "r"(x));
  return r;
}

// a word of K from ldmatrix (dims 4c..4c+3 of one token) -> the f16x2 pairs of the mma's k
// slots 2c, 2c+1 (dims 4c, 4c+1) and 2c+8, 2c+9 (dims 4c+2, 4c+3)
__device__ __forceinline__ void e4m3x4_k(u32 x, u32& lo, u32& hi) {
  lo = e4m3x2_to_f16x2(x);
  hi = e4m3x2_hi_to_f16x2(x);
}

// a word of V from ldmatrix.trans (token t: dims d, d+1; token t+1: dims d, d+1) -> the f16x2
// of dim d (tokens t, t+1) and of dim d+1
__device__ __forceinline__ void e4m3x4_v(u32 x, u32& d0, u32& d1) {
  const u32 y = __byte_perm(x, 0, 0x3120);
  d0 = e4m3x2_to_f16x2(y);
  d1 = e4m3x2_hi_to_f16x2(y);
}

// byte offset of 16-byte chunk `chunk` of row `row` in a box under the 128-byte swizzle
__device__ __forceinline__ u32 swz(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

#if F16
#define DT "f16"  // the model dtype in PTX type names
#else
#define DT "bf16"
#endif
#if KV_FP8
#define MT "f16"  // the products' type: e4m3 converts to f16 in one instruction
#else
#define MT DT
#endif

// d += a (16x16, row) * b (16x8, col); fp32 accumulators
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32." MT "." MT ".f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two floats -> the products' type, packed: lo in bits 0-15, hi in bits 16-31
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn." MT "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// a float -> the model dtype (the output)
__device__ __forceinline__ u16 to_half(float x) {
  u32 r;
  asm("cvt.rn." DT "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.f), "f"(x));
  return static_cast<u16>(r);
}

// two elements of q (the model dtype, packed) -> the products' type
__device__ __forceinline__ u32 q_pair(u32 x) {
#if KV_FP8 && !F16
  return pack2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
#else
  return x;
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

struct Item {
  int req, split, ctx, p0, p1;
};

__device__ __forceinline__ Item item_at(int item, int splits, int pages_per_split,
                                        const int* __restrict__ lens) {
  Item it;
  it.req = item / splits;
  it.split = item - it.req * splits;
  it.ctx = lens[it.req];
  int npages = (it.ctx + PAGE - 1) / PAGE;
  it.p0 = it.split * pages_per_split;
  it.p1 = min(it.p0 + pages_per_split, npages);
  return it;
}

// A position in the ring: the slot and the parity of its current use (its mbarriers' phase)
struct Ring {
  u32 slot, parity;
  __device__ __forceinline__ void next() {
    if (++slot == SLOTS) {
      slot = 0;
      parity ^= 1;
    }
  }
};

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
decode_bulk(const u16* __restrict__ q, const unsigned char* __restrict__ maps,
            const int* __restrict__ bt, const int* __restrict__ lens, u16* __restrict__ out,
            float* __restrict__ part, float* __restrict__ lse, int num_items, int splits,
            int pages_per_split, int bt_stride, int bt_cols, long long q_sn, long long q_sh,
            long long o_sn, long long o_sh, float scale_log2
#if KV_FP8
            , const float* __restrict__ ks, const float* __restrict__ vs, long long scale_page
#endif
            ) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const u32 ring = (smem_addr(smem) + 1023u) & ~1023u;  // the swizzle needs 1024-byte boxes
  const u32 full0 = ring + RING_BYTES;    // SLOTS mbarriers: a slot's bytes landed
  const u32 empty0 = full0 + 8 * SLOTS;   // SLOTS mbarriers: HKV consumers done with it

  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, HKV);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == HKV) {  // ---- producer ----
    // ids of pages p .. p + 31 of `item`'s request (one per lane), within its split and the table
    auto chunk_ids = [&](int item, int p) {
      if (item >= num_items) return 0;
      const int req = item / splits;
      const int end = min((item - req * splits + 1) * pages_per_split, bt_cols);
      return p + lane < end ? bt[(long long)req * bt_stride + p + lane] : 0;
    };
    Ring w = {0, 0};
    int item = blockIdx.x;  // the chunk being issued: pages p .. p + 31 of `item`
    int p = (item % splits) * pages_per_split;
    int ctx = item < num_items ? lens[item / splits] : 0;
    int ids = chunk_ids(item, p);
    while (item < num_items) {
      const int p1 = min((item % splits + 1) * pages_per_split, (ctx + PAGE - 1) / PAGE);
      // the next chunk (the rest of this split, else the next item's first), loaded now
      int nitem = item, np = p + 32, nctx = ctx;
      if (np >= p1) {
        nitem = item + gridDim.x;
        np = (nitem % splits) * pages_per_split;
        nctx = nitem < num_items ? lens[nitem / splits] : 0;
      }
      const int nids = chunk_ids(nitem, np);
      const int cnt = min(32, p1 - p);
      for (int j = 0; j < cnt; ++j) {
        const int page = __shfl_sync(FULL_MASK, ids, j);
#pragma unroll
        for (int x0 = 0; x0 < 2 * BOXES; x0 += SLOT_BOXES) {
          mbar_wait(empty0 + 8 * w.slot, w.parity ^ 1);
          if (lane == 0) {
            const u32 full = full0 + 8 * w.slot;
            mbar_expect_tx(full, SLOT_BOXES * BOX_BYTES + SCALE_BYTES);
#pragma unroll
            for (int b = 0; b < SLOT_BOXES; ++b) {
              const int x = x0 + b;  // box x of the page: K's boxes, then V's
              tma_load_4d(ring + w.slot * SLOT_BYTES + b * BOX_BYTES, maps + 128 * (x / BOXES),
                          BOX_DIMS * (x % BOXES), 0, 0, page, full);
            }
#if KV_FP8
            bulk_load(ring + w.slot * SLOT_BYTES + SLOT_BOXES * BOX_BYTES,
                      (x0 < BOXES ? ks : vs) + (long long)page * scale_page, SCALE_BYTES, full);
#endif
          }
          __syncwarp();
          w.next();
        }
      }
      item = nitem;
      p = np;
      ctx = nctx;
      ids = nids;
    }
    return;
  }

  // ---- consumers: warp h = KV head h ----
  const int h = warp, g = lane >> 2, c = lane & 3;
  // ldmatrix rows (lane l names row l & 7 of matrix l >> 3); box rows are head * PAGE + token.
  // K as A of S^T: matrices (tokens 0-7, 8-15) x two 16-byte chunks; bf16 V transposed as A of
  // O^T: (dims 0-7, 8-15 of a chunk pair) x (tokens 0-7, 8-15); FP8 V, transposed, as K
  const int k_row = h * PAGE + (lane & 15), k_hi = lane >> 4;
#if !KV_FP8
  const int v_row = h * PAGE + (lane & 7) + 8 * (lane >> 4), v_hi = (lane >> 3) & 1;
#endif
  // P^T's B fragment comes from lanes holding tokens 2c and 2c+1 of this lane's query head g
  const int src_a = (2 * c) * 4 + (g >> 1), src_b = (2 * c + 1) * 4 + (g >> 1);
  const bool q_ok = g < GROUP;

  const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
#if KV_FP8
  const int q_at = 4 * c, q_hi = 2;  // k slots 2c, 2c+1 | 2c+8, 2c+9: dims 4c, 4c+1 | 4c+2, 4c+3
#else
  const int q_at = 2 * c, q_hi = 8;  // dims 2c, 2c+1 | 2c+8, 2c+9
#endif
  u32 qf[KSTEPS][2];  // this item's q as B fragments of S^T's 16-dim steps
  auto load_q = [&](int req) {
    const u16* qp = q + req * q_sn + (h * GROUP + (q_ok ? g : 0)) * q_sh + q_at;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      qf[j][0] = q_ok ? q_pair(*reinterpret_cast<const u32*>(qp + 16 * j)) : 0u;
      qf[j][1] = q_ok ? q_pair(*reinterpret_cast<const u32*>(qp + 16 * j + q_hi)) : 0u;
    }
  };
  if (blockIdx.x < num_items) load_q(blockIdx.x / splits);

  Ring r = {0, 0};
  u32 slot_at = 0;  // shared-memory address of the slot being read
  // before box x of a page (K's boxes, then V's) is read: wait for its slot when x starts one
  auto acquire = [&](int x) {
    if (x % SLOT_BOXES == 0) {
      mbar_wait(full0 + 8 * r.slot, r.parity);
      slot_at = ring + r.slot * SLOT_BYTES;
    }
    return slot_at + (x % SLOT_BOXES) * BOX_BYTES;
  };
  // after box x was read: give its slot back when x ends one
  auto release = [&](int x) {
    if (x % SLOT_BOXES == SLOT_BOXES - 1) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * r.slot);
      r.next();
    }
  };
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const Item it = item_at(item, splits, pages_per_split, lens);
    const int next = item + gridDim.x;

    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float acc[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    for (int p = it.p0; p < it.p1; ++p) {
      if (CONSUME_ONLY) {  // the ring's copy ceiling: no products (the output is zeros)
#pragma unroll
        for (int x = 0; x < 2 * BOXES; ++x) {
          acquire(x);
          release(x);
        }
        continue;
      }
      // S^T: tokens g, g+8 x query heads 2c, 2c+1; two accumulators halve the mma chain
      float sc[4] = {0.f, 0.f, 0.f, 0.f}, sd[4] = {0.f, 0.f, 0.f, 0.f};
      u32 box = 0;
#if KV_FP8
      // the K slot: the page's K boxes, then its K scales [token][head]
      const u32 kslot = acquire(0);
      const float ks0 = ldsf(kslot + SLOT_BOXES * BOX_BYTES + (g * HKV + h) * 4);
      const float ks1 = ldsf(kslot + SLOT_BOXES * BOX_BYTES + ((g + 8) * HKV + h) * 4);
#pragma unroll
      for (int j = 0; j < KSTEPS; j += 2) {  // steps j, j+1: 16-byte chunks of each token row
        box = kslot + (j / STEPS_PER_BOX) * BOX_BYTES;
        u32 w0, w1, w2, w3;  // tokens g, g+8 of step j, then of step j+1
        ldsm_x4(box + swz(k_row, j % STEPS_PER_BOX + k_hi), w0, w1, w2, w3);
        u32 a0, a1, a2, a3;
        e4m3x4_k(w0, a0, a2);
        e4m3x4_k(w1, a1, a3);
        mma16816(sc, a0, a1, a2, a3, qf[j][0], qf[j][1]);
        e4m3x4_k(w2, a0, a2);
        e4m3x4_k(w3, a1, a3);
        mma16816(sd, a0, a1, a2, a3, qf[j + 1][0], qf[j + 1][1]);
      }
      release(SLOT_BOXES - 1);
#pragma unroll
      for (int k = 0; k < 4; ++k) sc[k] = (sc[k] + sd[k]) * (k < 2 ? ks0 : ks1);
#else
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        const int x = j >> 2;  // K's box of these 16 dims
        if ((j & 3) == 0) box = acquire(x);
        u32 a0, a1, a2, a3;
        ldsm_x4(box + swz(k_row, ((j & 3) << 1) + k_hi), a0, a1, a2, a3);
        if ((j & 3) == 3) release(x);
        mma16816(j & 1 ? sd : sc, a0, a1, a2, a3, qf[j][0], qf[j][1]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) sc[k] += sd[k];
#endif
      const int valid = it.ctx - p * PAGE;
      const float x0 = g < valid ? sc[0] * scale_log2 : NEG_INF;
      const float x1 = g < valid ? sc[1] * scale_log2 : NEG_INF;
      const float x2 = g + 8 < valid ? sc[2] * scale_log2 : NEG_INF;
      const float x3 = g + 8 < valid ? sc[3] * scale_log2 : NEG_INF;
      float pm0 = fmaxf(x0, x2), pm1 = fmaxf(x1, x3);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        pm0 = fmaxf(pm0, __shfl_xor_sync(FULL_MASK, pm0, o));
        pm1 = fmaxf(pm1, __shfl_xor_sync(FULL_MASK, pm1, o));
      }
      const float mn0 = fmaxf(m0, pm0), mn1 = fmaxf(m1, pm1);  // finite: a page has a token
      const float al0 = fast_exp2(m0 - mn0), al1 = fast_exp2(m1 - mn1);
      const float e0 = fast_exp2(x0 - mn0), e1 = fast_exp2(x1 - mn1);
      const float e2 = fast_exp2(x2 - mn0), e3 = fast_exp2(x3 - mn1);
      l0 = l0 * al0 + e0 + e2;
      l1 = l1 * al1 + e1 + e3;
      m0 = mn0;
      m1 = mn1;
#if KV_FP8
      // the V slot: the page's V boxes, then its V scales; a token's probabilities carry its
      // V scale into P.V (the row sums above do not)
      const u32 vslot = acquire(BOXES);
      const float vs0 = ldsf(vslot + SLOT_BOXES * BOX_BYTES + (g * HKV + h) * 4);
      const float vs1 = ldsf(vslot + SLOT_BOXES * BOX_BYTES + ((g + 8) * HKV + h) * 4);
      const u32 lo = pack2(e0 * vs0, e1 * vs0), hi = pack2(e2 * vs1, e3 * vs1);
#else
      const u32 lo = pack2(e0, e1), hi = pack2(e2, e3);  // tokens g, g+8; heads 2c, 2c+1
#endif
      const u32 lo_a = __shfl_sync(FULL_MASK, lo, src_a), hi_a = __shfl_sync(FULL_MASK, hi, src_a);
      const u32 lo_b = __shfl_sync(FULL_MASK, lo, src_b), hi_b = __shfl_sync(FULL_MASK, hi, src_b);
      const u32 b0 = __byte_perm(lo_a, lo_b, sel);  // tokens 2c, 2c+1 of head g
      const u32 b1 = __byte_perm(hi_a, hi_b, sel);  // tokens 2c+8, 2c+9
      // O's rescale, skipped while no query head's max moved (most pages after the first few)
      const bool rescale = __any_sync(FULL_MASK, al0 != 1.f || al1 != 1.f);
#if KV_FP8
#pragma unroll
      for (int i = 0; i < KSTEPS; i += 2) {
        if (rescale) {
#pragma unroll
          for (int t = i; t < i + 2; ++t) {
            acc[t][0] *= al0;
            acc[t][1] *= al1;
            acc[t][2] *= al0;
            acc[t][3] *= al1;
          }
        }
        // rows g, g+8 of an m-tile are dims 16i + 2g, 16i + 2g + 1 (steps i, i+1)
        box = vslot + (i / STEPS_PER_BOX) * BOX_BYTES;
        u32 w0, w1, w2, w3;  // tokens 2c, 2c+1 | 2c+8, 2c+9 of step i, then of step i+1
        ldsm_x4_t(box + swz(k_row, i % STEPS_PER_BOX + k_hi), w0, w1, w2, w3);
        u32 a0, a1, a2, a3;
        e4m3x4_v(w0, a0, a1);
        e4m3x4_v(w1, a2, a3);
        mma16816(acc[i], a0, a1, a2, a3, b0, b1);
        e4m3x4_v(w2, a0, a1);
        e4m3x4_v(w3, a2, a3);
        mma16816(acc[i + 1], a0, a1, a2, a3, b0, b1);
      }
#else
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        const int x = BOXES + (i >> 2);  // V's box of these 16 dims
        if ((i & 3) == 0) box = acquire(x);
        if (rescale) {
          acc[i][0] *= al0;
          acc[i][1] *= al1;
          acc[i][2] *= al0;
          acc[i][3] *= al1;
        }
        u32 a0, a1, a2, a3;
        ldsm_x4_t(box + swz(v_row, ((i & 3) << 1) + v_hi), a0, a1, a2, a3);
        if ((i & 3) == 3) release(x);
        mma16816(acc[i], a0, a1, a2, a3, b0, b1);
      }
#endif
#if KV_FP8
      release(2 * BOXES - 1);
#endif
    }

    // the next item's q, loaded while this one's result is reduced and written (q's registers
    // are free once the pages are read: held across them, 16 more)
    if (next < num_items) load_q(next / splits);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l0 += __shfl_xor_sync(FULL_MASK, l0, o);
      l1 += __shfl_xor_sync(FULL_MASK, l1, o);
    }
    // acc[i]: dims 16i+g (0, 1) and 16i+g+8 (2, 3) of query heads 2c (0, 2) and 2c+1 (1, 3);
    // with an FP8 cache dims 16i+2g and 16i+2g+1
#if KV_FP8
    const int d_lo = 2 * g, d_hi = 1;
#else
    const int d_lo = g, d_hi = 8;
#endif
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int qh = 2 * c + e;
      if (qh >= GROUP) continue;
      const float l = e ? l1 : l0, m = e ? m1 : m0;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int head = h * GROUP + qh;
      if (splits == 1) {
        u16* o = out + it.req * o_sn + head * o_sh + d_lo;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          o[16 * i] = to_half(acc[i][e] * inv);
          o[16 * i + d_hi] = to_half(acc[i][2 + e] * inv);
        }
      } else {
        const long long row = ((long long)it.req * HQ + head) * splits + it.split;
        float* o = part + row * HEAD_DIM + d_lo;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          o[16 * i] = acc[i][e] * inv;
          o[16 * i + d_hi] = acc[i][2 + e] * inv;
        }
        if (g == 0) lse[row] = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : NEG_INF;
      }
    }
  }
}
