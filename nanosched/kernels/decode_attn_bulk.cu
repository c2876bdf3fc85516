// Paged GQA decode attention for a few SMs (Hopper, sm_90): bulk copies into a shared-memory
// ring, tensor-core products. Built at run time through cupy (NVRTC) by decode_attn_bulk.py,
// which defines HKV, GROUP, HEAD_DIM, SLOTS, SLOT_BOXES and F16 (0: bf16, 1: fp16).
//
// Contract (that of reference.decode_attention): q [n, HKV*GROUP, HEAD_DIM]; K and V caches
// [P, PAGE, HKV, HEAD_DIM], each page contiguous; block table [n, bt_cols] int32 (row stride
// bt_stride); context lengths [n] int32. A work item is (request, split): `pages_per_split`
// consecutive pages of one request, all KV heads. The grid is persistent (`gridDim.x` CTAs, one
// per SM: the ring takes most of its shared memory), each CTA taking items blockIdx.x,
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
// Roles: warp HKV is the producer. One lane issues the tensor copies of each slot through the
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
// parity 1, which a fresh mbarrier passes. A partial last page is copied whole: its scores past
// the context are masked to -inf, and its rows there hold earlier K/V of the cache (finite: the
// cache is zeroed when allocated), weighted by 0.
//
// Output: one split per request writes the normalised result to `out` in the model dtype;
// several write fp32 partials `part` [n, Hq, splits, HEAD_DIM] and their log-sum-exp `lse`
// [n, Hq, splits] (natural log), which the Triton merge kernel of decode_attn.py combines.
// An item with no tokens (a padded row) writes zeros and lse = -inf.

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

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define PAGE 16
#define HQ (HKV * GROUP)
#define BOX_BYTES (64 * 2 * PAGE * HKV)  // one tensor copy: 64 dims of every token and head
#define BOXES (HEAD_DIM / 64)             // boxes of a page's K (and of its V)
#define SLOT_BYTES (SLOT_BOXES * BOX_BYTES)
#define RING_BYTES (SLOTS * SLOT_BYTES)
#define THREADS ((HKV + 1) * 32)
#define KSTEPS (HEAD_DIM / 16)
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

static_assert(GROUP >= 1 && GROUP <= 8, "a KV head's query heads fill at most the mma's N = 8");
static_assert(HEAD_DIM % 64 == 0, "head_dim must be a multiple of 64 (128-byte boxes)");
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

// d += a (16x16, row) * b (16x8, col); fp32 accumulators
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32." DT "." DT ".f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two floats -> the model dtype, packed: lo in bits 0-15, hi in bits 16-31
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn." DT "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u16 to_half(float x) { return static_cast<u16>(pack2(x, 0.f)); }

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

extern "C" __global__ void __launch_bounds__(THREADS, 1)
decode_bulk(const u16* __restrict__ q, const unsigned char* __restrict__ maps,
            const int* __restrict__ bt, const int* __restrict__ lens, u16* __restrict__ out,
            float* __restrict__ part, float* __restrict__ lse, int num_items, int splits,
            int pages_per_split, int bt_stride, int bt_cols, long long q_sn, long long q_sh,
            long long o_sn, long long o_sh, float scale_log2) {
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
            mbar_expect_tx(full, SLOT_BYTES);
#pragma unroll
            for (int b = 0; b < SLOT_BOXES; ++b) {
              const int x = x0 + b;  // box x of the page: K's boxes, then V's
              tma_load_4d(ring + w.slot * SLOT_BYTES + b * BOX_BYTES, maps + 128 * (x / BOXES),
                          64 * (x % BOXES), 0, 0, page, full);
            }
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
  // ldmatrix rows (lane l names row l & 7 of matrix l >> 3): K as A of S^T (rows = tokens,
  // 16 dims per step), V transposed as A of O^T (rows = dims); box rows are head * PAGE + token
  const int k_row = h * PAGE + (lane & 15), k_hi = lane >> 4;
  const int v_row = h * PAGE + (lane & 7) + 8 * (lane >> 4), v_hi = (lane >> 3) & 1;
  // P^T's B fragment comes from lanes holding tokens 2c and 2c+1 of this lane's query head g
  const int src_a = (2 * c) * 4 + (g >> 1), src_b = (2 * c + 1) * 4 + (g >> 1);
  const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
  const bool q_ok = g < GROUP;

  u32 qf[KSTEPS][2], qn[KSTEPS][2];
  auto load_q = [&](u32 (*dst)[2], int req) {
    const u16* qp = q + req * q_sn + (h * GROUP + (q_ok ? g : 0)) * q_sh + 2 * c;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      dst[j][0] = q_ok ? *reinterpret_cast<const u32*>(qp + 16 * j) : 0u;
      dst[j][1] = q_ok ? *reinterpret_cast<const u32*>(qp + 16 * j + 8) : 0u;
    }
  };
  if (blockIdx.x < num_items) load_q(qf, blockIdx.x / splits);

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
    if (next < num_items) load_q(qn, next / splits);  // used next item: its latency hides

    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float acc[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    for (int p = it.p0; p < it.p1; ++p) {
      // S^T: tokens g, g+8 x query heads 2c, 2c+1; two accumulators halve the mma chain
      float sc[4] = {0.f, 0.f, 0.f, 0.f}, sd[4] = {0.f, 0.f, 0.f, 0.f};
      u32 box = 0;
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
      const u32 lo = pack2(e0, e1), hi = pack2(e2, e3);  // tokens g, g+8; heads 2c, 2c+1
      const u32 lo_a = __shfl_sync(FULL_MASK, lo, src_a), hi_a = __shfl_sync(FULL_MASK, hi, src_a);
      const u32 lo_b = __shfl_sync(FULL_MASK, lo, src_b), hi_b = __shfl_sync(FULL_MASK, hi, src_b);
      const u32 b0 = __byte_perm(lo_a, lo_b, sel);  // tokens 2c, 2c+1 of head g
      const u32 b1 = __byte_perm(hi_a, hi_b, sel);  // tokens 2c+8, 2c+9
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        const int x = BOXES + (i >> 2);  // V's box of these 16 dims
        if ((i & 3) == 0) box = acquire(x);
        acc[i][0] *= al0;
        acc[i][1] *= al1;
        acc[i][2] *= al0;
        acc[i][3] *= al1;
        u32 a0, a1, a2, a3;
        ldsm_x4_t(box + swz(v_row, ((i & 3) << 1) + v_hi), a0, a1, a2, a3);
        if ((i & 3) == 3) release(x);
        mma16816(acc[i], a0, a1, a2, a3, b0, b1);
      }
    }

#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l0 += __shfl_xor_sync(FULL_MASK, l0, o);
      l1 += __shfl_xor_sync(FULL_MASK, l1, o);
    }
    // acc[i]: dims 16i+g (0, 1) and 16i+g+8 (2, 3) of query heads 2c (0, 2) and 2c+1 (1, 3)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int qh = 2 * c + e;
      if (qh >= GROUP) continue;
      const float l = e ? l1 : l0, m = e ? m1 : m0;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int head = h * GROUP + qh;
      if (splits == 1) {
        u16* o = out + it.req * o_sn + head * o_sh + g;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          o[16 * i] = to_half(acc[i][e] * inv);
          o[16 * i + 8] = to_half(acc[i][2 + e] * inv);
        }
      } else {
        const long long row = ((long long)it.req * HQ + head) * splits + it.split;
        float* o = part + row * HEAD_DIM + g;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          o[16 * i] = acc[i][e] * inv;
          o[16 * i + 8] = acc[i][2 + e] * inv;
        }
        if (g == 0) lse[row] = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : NEG_INF;
      }
    }
    if (next < num_items) {
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        qf[j][0] = qn[j][0];
        qf[j][1] = qn[j][1];
      }
    }
  }
}
