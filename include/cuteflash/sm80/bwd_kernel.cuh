// sm80 backward kernels: FlashAttention-2's dQ, dK, dV with ldmatrix + mma.sync.m16n8k16 + cp.async.
//
// After D = rowsum(dO * O) (bwd_preprocess.cuh), the main kernel owns kBlockN keys of one
// (batch, head) and walks the query blocks that see them, recomputing P from Q, K and the saved
// log-sum-exp. One step:
//   S = Q K^T  ->  P = exp(scale S - lse) to shared memory  ->  dP = dO V^T  ->  dS = P (dP - D) too
//   dV += P^T dO  ->  dK += dS^T Q  ->  dQ = dS K (fp32 atomics into dq_accum)
// dK and dV stay in registers until the end. dS carries the softmax scale (dS = scale P (dP - D)), so
// the products give dQ and dK directly. The next step's loads hide behind this one's products: Q
// (double-buffered) is issued right after S, dO once dV has read the current one.
#pragma once

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/dropout.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/sm80/fwd_kernel.cuh"
#include "cuteflash/sm80/traits.h"
#include "cuteflash/common/utils.cuh"

namespace cuteflash::sm80 {

// In place on a (rows, cols) view of S in a step of step_with_options (mask.cuh): the options' changes (the
// softcap's factors into dtanh), the mask where the block needs it, then P = exp(scale S - lse). coord: (row, col)
// of each score in the tile whose first query row and key are row0 and col0; lse_log2: lse * log2(e) per row
// (+inf for rows past seqlen_q: P = 0).
template <Variant V, typename STensor, typename DTanh, typename Coord, int kRows, typename Masked, typename NoAlibi>
__device__ __forceinline__ void scores_to_probs(STensor& s, DTanh& dtanh, Coord const& coord, int row0, int col0,
                                                BwdParams const& p, Sequence const& seq, int head,
                                                float const (&lse_log2)[kRows], Masked, NoAlibi no_alibi) {
  if constexpr (has_options(V))
    apply_score_mods<V>(s, coord, row0, col0, step_score_mods(p, seq, head, no_alibi), dtanh);
  if constexpr (Masked::value) apply_mask(s, coord, row0, col0, mask_policy<V>(p, seq));
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2_approx(s(mi, ni) * p.softmax_scale_log2 - lse_log2[mi]);
  }
}

// The factor of dS = scale P (dP - D) for a kernel of variant V: the softmax's scale, with has_softcap times the
// softcap (params.h), so that apply_softcap_grad has only 1 - tanh^2 left to apply.
template <Variant V>
__device__ __forceinline__ float grad_scale(BwdParams const& p) {
  return has_softcap(V) ? p.softmax_scale * p.softcap : p.softmax_scale;
}

// In place on (rows, cols) views: dp becomes dS = scale P (dP - D), the gradient of the unscaled scores.
template <typename PTensor, typename DPTensor, int kRows>
__device__ __forceinline__ void probs_to_grads(PTensor const& prob, DPTensor& dp, float const (&d)[kRows],
                                               float scale) {
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) = prob(mi, ni) * scale * (dp(mi, ni) - d[mi]);
  }
}

// lse * log2(e) and D of the rows this thread holds (coord: (row, col) in the tile's (rows, cols) view).
template <typename Coord, int kRows>
__device__ __forceinline__ void load_row_stats(BwdParams const& p, int64_t row_stats, int seqlen_q, int row0,
                                               Coord const& coord, float (&lse_log2)[kRows], float (&d)[kRows]) {
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const RowStats row(p, row_stats, row0 + get<0>(coord(mi, 0)), seqlen_q);
    lse_log2[mi] = row.lse_log2();
    d[mi] = row.d;
  }
}

// The (kRows, kHeadDim) tile of dq that query block m_block writes.
template <int kRows, int kHeadDim, typename Element>
__device__ __forceinline__ auto dq_tile(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  return head_rows<kRows, kHeadDim, Element>(p.dq, seq.batch, head, seq.q_row0).block(m_block);
}

// How many consecutive dQ accumulator elements a thread adds with one reduction: sm90 has 16-byte ones,
// a quarter of the reduction instructions (2 % faster backward at d=256 on H200). They need PTX ISA 8.1, which
// nvcc emits from CUDA 12.1 on; an older nvcc builds sm90 with the scalar reductions.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
constexpr int kDqAccumVec = 4;
#else
constexpr int kDqAccumVec = 1;
#endif

// This thread's slots in the dq_accum block of query block m_block (whole blocks, params.h): elements
// i..i+kDqAccumVec-1 (i a multiple of kDqAccumVec) of dQ's accumulator partition at [i * kNThreads], so
// that the same elements of all threads lie side by side and a warp's reduction covers whole 128-byte
// lines. bwd_kernel adds there, convert_dq_kernel reads back.
template <typename Traits>
__device__ __forceinline__ float* dq_accum_slots(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  return dq_accum_region<Traits::kHeadDim>(p, seq, head) + m_block * Traits::kBlockM * Traits::kHeadDim +
         threadIdx.x * kDqAccumVec;
}

// acc += A B^T for the calling thread (tid) of tiled_mma, A (M, K) and B (N, K) in shared memory (sA, sB), read with
// ldmatrix (AtomA, AtomB) a k-slice ahead (gemm_ss). offset (elements, optional) moves A's and B's partitions: the
// stages of a multi-buffered operand.
template <typename AtomA, typename AtomB, typename Acc, typename TiledMma, typename SmemA, typename SmemB,
          typename... Offset>
__device__ __forceinline__ void gemm_smem(Acc& acc, TiledMma const& tiled_mma, SmemA const& sA, SmemB const& sB,
                                          int tid, Offset... offset) {
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor rA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K)
  Tensor rB = thr_mma.partition_fragment_B(sB);  // (MMA, MMA_N, MMA_K)
  auto copy_a = make_tiled_copy_A(AtomA{}, tiled_mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto copy_b = make_tiled_copy_B(AtomB{}, tiled_mma);
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor pA = thr_a.partition_S(sA);
  Tensor pB = thr_b.partition_S(sB);
  if constexpr (sizeof...(offset) == 0) {
    gemm_ss(acc, rA, rB, pA, pB, tiled_mma, copy_a, thr_a, copy_b, thr_b);
  } else {
    const int at[2] = {offset...};
    gemm_ss(acc, rA, rB, make_tensor(pA.data() + at[0], pA.layout()), make_tensor(pB.data() + at[1], pB.layout()),
            tiled_mma, copy_a, thr_a, copy_b, thr_b);
  }
}

// Without cp.async (kCpAsync false), query_loader's loads through registers: fetch(m_block) reads the block into
// registers, issued a step ahead so that its latency hides behind the products, and the call stores them to the tile
// (m_block: the block fetched; offset as query_loader's).
template <typename Traits, typename Rows, typename ThrCopy, typename Dst, typename Coord>
struct StagedQueryLoader {
  BwdParams const& p;
  Sequence const& seq;
  Rows rows;
  typename Traits::GmemTiledCopy gmem_copy;
  ThrCopy gmem_thr;
  Dst dst;      // (CPY, CPY_M, CPY_K)
  Coord coord;  // the (row, col) in the block of each chunk of dst
  decltype(make_fragment_like(dst)) staged;

  __device__ __forceinline__ void fetch(int m_block) {
    Tensor src = gmem_thr.partition_S(rows.block(m_block));  // (CPY, CPY_M, CPY_K)
    if (p.head_dim == Traits::kHeadDim && (m_block + 1) * Traits::kBlockM <= seq.seqlen_q) {
      copy(gmem_copy, src, staged);
    } else {
      copy_tile_bounded<true>(gmem_copy, src, staged, coord, seq.seqlen_q - m_block * Traits::kBlockM, p.head_dim);
    }
  }

  __device__ __forceinline__ void operator()(int /*m_block*/, int offset = 0) {
    copy(gmem_copy, staged, make_tensor(dst.data() + offset, dst.layout()));
  }
};

// The fetch of a query_loader's block: StagedQueryLoader's; nothing for the cp.async loader, which loads when called.
// (Overloads, not `if constexpr` on the loader's type: CUDA 11.8 instantiates the discarded branch in bwd_block's
// lambda and finds no fetch() on the cp.async loader.)
template <typename Loader>
__device__ __forceinline__ void fetch_query_block(Loader&, int) {}

template <typename Traits, typename Rows, typename ThrCopy, typename Dst, typename Coord>
__device__ __forceinline__ void fetch_query_block(StagedQueryLoader<Traits, Rows, ThrCopy, Dst, Coord>& loader,
                                                  int m_block) {
  loader.fetch(m_block);
}

// A loader of query block m_block of rows (a head's query rows: gQ, gdO) into the shared tile s (kBlockM, kHeadDim)
// with cp.async, zeros past seqlen_q and head_dim. Its offset (elements) moves the destination: a stage of a
// multi-buffered tile. A whole query block without a head-dim remainder loads without bounds checks (whose
// zero-filling stores nvcc would otherwise issue, predicated off, in every step). Without cp.async, a
// StagedQueryLoader, whose fetch (fetch_query_block) the caller issues first.
template <typename Traits, typename Rows, typename SmemTile>
__device__ __forceinline__ auto query_loader(BwdParams const& p, Sequence const& seq, Rows const& rows,
                                             SmemTile const& s, int tid) {
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  if constexpr (!Traits::kCpAsync) {
    Tensor dst = gmem_thr.partition_D(s);
    Tensor coord = gmem_thr.partition_S(make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}));
    return StagedQueryLoader<Traits, Rows, decltype(gmem_thr), decltype(dst), decltype(coord)>{
        p, seq, rows, gmem_copy, gmem_thr, dst, coord};
  } else {
    return [&p, &seq, rows, gmem_copy, gmem_thr, full_head_dim = p.head_dim == Traits::kHeadDim,
            dst = gmem_thr.partition_D(s),
            coord = gmem_thr.partition_S(make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}))](
               int m_block, int offset = 0) {
      Tensor src = gmem_thr.partition_S(rows.block(m_block));  // (CPY, CPY_M, CPY_K)
      Tensor at = make_tensor(dst.data() + offset, dst.layout());
      if (full_head_dim && (m_block + 1) * Traits::kBlockM <= seq.seqlen_q) {
        copy(gmem_copy, src, at);
      } else {
        copy_tile_bounded<true>(gmem_copy, src, at, coord, seq.seqlen_q - m_block * Traits::kBlockM, p.head_dim);
      }
    };
  }
}

// P to its shared tile (copy_pds's partition tPsP) from the accumulators acc_s: with dropout, the kept probabilities
// (keep: keep_mask's bits), unscaled (dV's products take them; bwd_epilogue scales).
template <typename Element, Variant V, typename AccS, typename Keep, typename CopyPdS, typename ThrPdS, typename SmemP>
__device__ __forceinline__ void store_probs(AccS const& acc_s, Keep const& keep, CopyPdS const& copy_pds,
                                            ThrPdS const& thr_pds, SmemP& tPsP) {
  if constexpr (has_dropout(V)) {
    Tensor kept = make_fragment_like(acc_s);
    Tensor kept_rc = make_tensor(kept.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int i = 0; i < size(kept); ++i) kept(i) = acc_s(i);
    apply_keep(kept_rc, keep, 1.f);
    copy(copy_pds, thr_pds.retile_S(convert_fragment<Element>(kept)), tPsP);
  } else {
    copy(copy_pds, thr_pds.retile_S(convert_fragment<Element>(acc_s)), tPsP);
  }
}

// dQ += dS K for query block m_block, added to dq_accum with fp32 reductions (whole blocks: rows past seqlen_q and
// columns past head_dim add zeros to the padding). sdS, sKt: dS (kBlockM, kBlockN) and K^T in shared memory.
template <typename Traits, typename SmemDs, typename SmemKt>
__device__ __forceinline__ void add_dq(BwdParams const& p, Sequence const& seq, int head, int m_block,
                                       SmemDs const& sdS, SmemKt const& sKt, int tid) {
  typename Traits::TiledMmadQ mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});  // (MMA, M, D)
  clear(acc_dq);
  gemm_smem<typename Traits::SmemCopyAtom, typename Traits::SmemCopyAtomTransposed>(acc_dq, mma_dq, sdS, sKt, tid);
  float* slots = dq_accum_slots<Traits>(p, seq, head, m_block);  // no bounds checks: whole blocks
  static_assert(decltype(size(acc_dq))::value % kDqAccumVec == 0);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += kDqAccumVec) {
    if constexpr (kDqAccumVec == 4) {
      global_red_add_v4(slots + i * Traits::kNThreads, &acc_dq(i));
    } else {
      global_red_add(slots + i * Traits::kNThreads, acc_dq(i));
    }
  }
}

// The end of a key block: dK and dV through the shared memory of K and V (no warp reads them any more); a key block no
// query sees gets zeros. With dropout, dV's products took the kept probabilities without 1 / (1 - p): scaled here.
template <typename Traits, Variant V, typename AccDk, typename MmaDkv>
__device__ __forceinline__ void bwd_epilogue(BwdParams const& p, Sequence const& seq, int head, int n_block,
                                             AccDk& acc_dk, AccDk& acc_dv, MmaDkv const& mma_dkv,
                                             typename Traits::SharedStorage& smem, int keys_left) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  Tensor gdK = head_rows<kBlockN, kHeadDim, Element>(p.dk, seq.batch, head, seq.k_row0).block(n_block);
  Tensor gdV = head_rows<kBlockN, kHeadDim, Element>(p.dv, seq.batch, head, seq.k_row0).block(n_block);
  __syncthreads();  // no warp reads K or V any more
  if constexpr (has_dropout(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) acc_dv(i) *= p.dropout_scale;
  }
  using Fwd = typename Traits::Fwd;
  store_acc_tile<Fwd, kBlockN>(acc_dk, mma_dkv, smem.k.data(), gdK, keys_left, p.head_dim, threadIdx.x);
  store_acc_tile<Fwd, kBlockN>(acc_dv, mma_dkv, smem.v.data(), gdV, keys_left, p.head_dim, threadIdx.x);
}

// Key block n_block of one (sequence, head).
template <typename Traits, Variant V>
__device__ __forceinline__ void bwd_block(BwdParams const& p, Sequence const& seq, int head, int n_block) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQStages = Traits::kQStages;

  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int keys_left = seq.seqlen_k - n_block * kBlockN;
  // The query blocks with a row that sees a key of this block, and those that need no mask.
  const BlockRange queries = mask_policy<V>(p, seq).template query_blocks<kBlockM, kBlockN>(n_block);

  const auto gQ = head_rows<kBlockM, kHeadDim, Element const>(p.q, seq.batch, head, seq.q_row0);
  const auto gdO = head_rows<kBlockM, kHeadDim, Element const>(p.dout, seq.batch, head, seq.q_row0);
  // block(i) of gQ, gdO: (kBlockM, kHeadDim)
  Tensor gK = head_rows<kBlockN, kHeadDim, Element const>(p.k, seq.batch, head_k, seq.k_row0).block(n_block);
  Tensor gV = head_rows<kBlockN, kHeadDim, Element const>(p.v, seq.batch, head_k, seq.k_row0).block(n_block);
  // gK, gV: (kBlockN, kHeadDim)
  const int64_t row_stats = seq.stats(p, head);

  // Q's stage s lives at smem.q + s * kQSize; the partitions below are of stage 0 and get the offset of
  // the current stage added to their pointers.
  constexpr int kQSize = cosize_v<typename Traits::SmemLayoutQ>;
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});        // (kBlockM, kHeadDim)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});    // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});       // (kBlockN, kHeadDim)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});       // (kBlockN, kHeadDim)
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});      // (kHeadDim, kBlockM)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});  // (kHeadDim, kBlockM)
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});      // (kHeadDim, kBlockN)
  Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdS{});      // (kBlockM, kBlockN)
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdS{});    // (kBlockM, kBlockN)
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdSt{});    // (kBlockN, kBlockM)
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdSt{});  // (kBlockN, kBlockM)

  // ---- Loads: K and V once, Q and dO per query block (zero-filled past seqlen and head_dim).
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKVcKV, keys_left, p.head_dim);
  copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gV), gmem_thr.partition_D(sV), tKVcKV, keys_left, p.head_dim);
  auto load_q = query_loader<Traits>(p, seq, gQ, sQ, tid);  // (m_block, stage * kQSize)
  auto load_do = query_loader<Traits>(p, seq, gdO, sdO, tid);
  if (!queries.empty()) {
    fetch_query_block(load_q, queries.begin);
    fetch_query_block(load_do, queries.begin);
    load_q(queries.begin, 0);
    load_do(queries.begin);
  }
  cp_async_commit();

  // ---- The products, both operands from shared memory (gemm_smem): S = Q K^T and dP = dO V^T, (kBlockM, kBlockN);
  // dV = P^T dO and dK = dS^T Q, (kBlockN, kHeadDim), all read transposed; dQ = dS K (add_dq).
  using Atom = typename Traits::SmemCopyAtom;
  using AtomT = typename Traits::SmemCopyAtomTransposed;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(tid);
  Tensor tPsP = thr_pds.partition_D(sP);
  Tensor tdSsdS = thr_pds.partition_D(sdS);
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  int q_stage = 0;
  // A step of step_with_options (mask.cuh), always_inline as the forward kernel's.
  auto step = [&](int m_block, auto masked, auto no_alibi) __attribute__((always_inline)) {
    const bool has_next = m_block + 1 < queries.end;
    cp_async_wait<0>();
    __syncthreads();  // Q and dO of this block (and K, V) are in shared memory
    if (has_next) {   // without cp.async, the next block into registers, stored below where this one's buffers are free
      fetch_query_block(load_q, m_block + 1);
      fetch_query_block(load_do, m_block + 1);
    }

    float lse_log2[kRows], d[kRows];  // loaded first: the products hide the global loads' latency
    load_row_stats(p, row_stats, seq.seqlen_q, m_block * kBlockM, tScS_rc, lse_log2, d);
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    gemm_smem<Atom, Atom>(acc_s, mma_sdp, sQ, sK, tid, q_stage * kQSize, 0);
    if (kQStages == 2 && has_next) {  // the other stage was last read before this step's barrier
      load_q(m_block + 1, (q_stage ^ 1) * kQSize);
      cp_async_commit();
    }

    // P, in place; rows past seqlen_q get lse = +inf: P = 0.
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
    Tensor dtanh = make_fragment_like(s);  // has_softcap: the softcap's 1 - tanh^2 (dead code otherwise)
    scores_to_probs<V>(s, dtanh, tScS_rc, m_block * kBlockM, n_block * kBlockN, p, seq, head, lse_log2, masked,
                       no_alibi);
    // has_dropout: the probabilities that dropout keeps (a bit each), for P's copy and for dP.
    const auto keep = keep_mask_if<has_dropout(V)>(p, seq.batch, head, tScS_rc, m_block * kBlockM, n_block * kBlockN);
    store_probs<Element, V>(acc_s, keep, copy_pds, thr_pds, tPsP);

    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem<Atom, Atom>(acc_dp, mma_sdp, sdO, sV, tid);
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));  // (rows, cols)
    if constexpr (has_dropout(V)) apply_keep(dp, keep, p.dropout_scale);  // the kept probabilities' gradient
    probs_to_grads(s, dp, d, grad_scale<V>(p));
    if constexpr (has_softcap(V)) apply_softcap_grad(dp, dtanh);
    copy(copy_pds, thr_pds.retile_S(convert_fragment<Element>(acc_dp)), tdSsdS);
    __syncthreads();  // P and dS are in shared memory

    gemm_smem<AtomT, AtomT>(acc_dv, mma_dkv, sPt, sdOt, tid);
    if (has_next) {
      __syncthreads();  // no warp reads dO any more
      load_do(m_block + 1);
      cp_async_commit();
    }

    // One call, the Q stage in its pointer: with a call per stage in two branches, nvcc predicates both
    // and issues them all.
    gemm_smem<AtomT, AtomT>(acc_dk, mma_dkv, sdSt, sQt, tid, 0, q_stage * kQSize);
    if (kQStages == 1 && has_next) {
      __syncthreads();  // no warp reads Q any more
      load_q(m_block + 1, 0);
      cp_async_commit();
    }
    // dQ last: the registers its reductions read are reused by the next step's first products only after
    // the loop's barrier, not by dK's fragment loads right away, which would wait for the reductions.
    if (!p.deterministic) {
      add_dq<Traits>(p, seq, head, m_block, sdS, sKt, tid);
    }
    q_stage ^= kQStages - 1;
  };
  for (int m_block = queries.begin; m_block < queries.end; ++m_block) step_with_options<V>(p, queries, m_block, step);
  cp_async_wait<0>();

  bwd_epilogue<Traits, V>(p, seq, head, n_block, acc_dk, acc_dv, mma_dkv, smem, keys_left);
}

// One thread block per key block of each (sequence, head) (sequence.cuh).
template <typename Traits, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads) bwd_kernel(const BwdParams p) {
  for_each_tile<V>(
      p, blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_k, Traits::kBlockN); },
      [&](Sequence const& seq, int n_block) { bwd_block<Traits, V>(p, seq, blockIdx.y, n_block); });
}

// dq = dq_accum for the regions bwd_kernel<Traits> wrote: one thread block per query block, each thread
// reading back the accumulator elements it added (coalesced) and storing them at their (row, column).
template <typename Traits>
__device__ __forceinline__ void convert_dq_block(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x;

  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
  float const* slots = dq_accum_slots<Traits>(p, seq, head, m_block);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += kDqAccumVec) {
    CUTE_UNROLL
    for (int j = 0; j < kDqAccumVec; ++j) acc_dq(i + j) = slots[i * Traits::kNThreads + j];
  }
  extern __shared__ __align__(128) char smem_raw[];
  store_acc_tile<typename Traits::Fwd, kBlockM>(acc_dq, mma_dq, reinterpret_cast<Element*>(smem_raw),
                                                dq_tile<kBlockM, kHeadDim, Element>(p, seq, head, m_block),
                                                seq.seqlen_q - m_block * kBlockM, p.head_dim, threadIdx.x);
}

template <typename Traits, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads) convert_dq_kernel(const BwdParams p) {
  for_each_tile<V>(
      p, blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { convert_dq_block<Traits>(p, seq, blockIdx.y, m_block); });
}

// Deterministic dQ: one thread block per query block walks the key blocks it sees (in a fixed order),
// recomputing S and dP, and keeps dQ += dS K in registers. The forward kernel's shape: warps along the
// query rows, dS fed to the next MMA straight from the accumulators, K^T read like V^T there.
template <typename Element, int kHeadDim>
using DqTraits = FwdTraits<Element, kHeadDim, 64, 64, 4>;

template <typename Traits>
struct DqSharedStorage {
  array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutQ>> q, dout;
  array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutKV>> k, v;
};

template <typename Traits, Variant V>
__device__ __forceinline__ void bwd_dq_block(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<DqSharedStorage<Traits>*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int rows_left = seq.seqlen_q - m_block * kBlockM;

  Tensor gQ = head_rows<kBlockM, kHeadDim, Element const>(p.q, seq.batch, head, seq.q_row0).block(m_block);
  Tensor gdO = head_rows<kBlockM, kHeadDim, Element const>(p.dout, seq.batch, head, seq.q_row0).block(m_block);
  const auto gK = head_rows<kBlockN, kHeadDim, Element const>(p.k, seq.batch, head_k, seq.k_row0);
  const auto gV = head_rows<kBlockN, kHeadDim, Element const>(p.v, seq.batch, head_k, seq.k_row0);
  // gQ, gdO: (kBlockM, kHeadDim); block(i) of gK, gV: (kBlockN, kHeadDim)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});      // (kBlockM, kHeadDim)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});     // (kBlockN, kHeadDim)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});     // (kBlockN, kHeadDim)
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutVt{});    // (kHeadDim, kBlockN)
  Tensor gdQ = dq_tile<kBlockM, kHeadDim, Element>(p, seq, head, m_block);                    // (kBlockM, kHeadDim)

  // A block that sees no key (causal, seqlen_q > seqlen_k; seqlen_k = 0) has dQ = 0 and loads nothing: the
  // epilogue reuses sQ, which a Q copy still in flight (awaited only inside the key loop) would overwrite.
  const BlockRange keys = mask_policy<V>(p, seq).template key_blocks<kBlockM, kBlockN>(m_block);
  if (keys.empty()) {
    store_zero_tile<Traits>(sQ, gdQ, rows_left, p.head_dim, threadIdx.x);
    return;
  }

  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gQ), gmem_thr.partition_D(sQ), tQcQ, rows_left, p.head_dim);
  copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gdO), gmem_thr.partition_D(sdO), tQcQ, rows_left, p.head_dim);

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K)
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdQrKt = thr_mma.partition_fragment_B(sKt);  // (MMA, MMA_D, MMA_K over keys)
  auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtomA{}, tiled_mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtomB{}, tiled_mma);
  auto thr_b = copy_b.get_thread_slice(tid);
  auto copy_bt = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_bt = copy_bt.get_thread_slice(tid);
  Tensor tSsQ = thr_a.partition_S(sQ);
  Tensor tdPsdO = thr_a.partition_S(sdO);
  Tensor tSsK = thr_b.partition_S(sK);
  Tensor tdPsV = thr_b.partition_S(sV);
  Tensor tdQsKt = thr_bt.partition_S(sKt);
  Tensor acc_dq = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
  clear(acc_dq);

  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  float lse_log2[kRows], d_row[kRows];
  load_row_stats(p, seq.stats(p, head), seq.seqlen_q, m_block * kBlockM, tScS_rc, lse_log2, d_row);

  // A step of step_with_options (mask.cuh), always_inline as the forward kernel's.
  auto step = [&](int n_block, auto masked, auto no_alibi) __attribute__((always_inline)) {
    __syncthreads();  // no warp still reads the previous K and V
    int keys_left = seq.seqlen_k - n_block * kBlockN;
    copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gK.block(n_block)), tKsK, tKVcKV, keys_left, p.head_dim);
    copy_tile_bounded<true>(gmem_copy, gmem_thr.partition_S(gV.block(n_block)), tVsV, tKVcKV, keys_left, p.head_dim);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
    Tensor acc_dp = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, copy_a, thr_a, copy_b, thr_b);
    gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, tiled_mma, copy_a, thr_a, copy_b, thr_b);
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    Tensor dtanh = make_fragment_like(s);  // has_softcap: the softcap's 1 - tanh^2 (dead code otherwise)
    scores_to_probs<V>(s, dtanh, tScS_rc, m_block * kBlockM, n_block * kBlockN, p, seq, head, lse_log2, masked,
                       no_alibi);
    if constexpr (has_dropout(V)) {  // the gradient of the kept probabilities
      apply_dropout(dp, Dropout::make(p, seq.batch, head), tScS_rc, m_block * kBlockM, n_block * kBlockN,
                    p.dropout_scale);
    }
    probs_to_grads(s, dp, d_row, grad_scale<V>(p));
    if constexpr (has_softcap(V)) apply_softcap_grad(dp, dtanh);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    Tensor tdQrdS = make_tensor(rdS.data(), acc_as_a_operand<Traits::kMmaK>(rdS.layout()));  // (MMA, M, K: keys)
    gemm_rs(acc_dq, tdQrdS, tdQrKt, tdQsKt, tiled_mma, copy_bt, thr_bt);
  };
  // Two copies of the step: with a third (no ALiBi), the head-dim-256 kernel with dropout spilled 700 bytes.
  for (int n_block = keys.end - 1; n_block >= keys.begin; --n_block) {
    step_with_options<V, false>(p, keys, n_block, step);
  }

  __syncthreads();  // no warp reads Q any more (the loop ran at least once: every copy has landed)
  store_acc_tile<Traits, kBlockM>(acc_dq, tiled_mma, smem.q.data(), gdQ, rows_left, p.head_dim, threadIdx.x);
}

template <typename Traits, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads) bwd_dq_kernel(const BwdParams p) {
  for_each_tile<V>(
      p, blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { bwd_dq_block<Traits, V>(p, seq, blockIdx.y, m_block); });
}

}  // namespace cuteflash::sm80
