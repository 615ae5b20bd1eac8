// Exhaustive check of MaskPolicy (include/cuteflash/mask.h) against a brute-force mask over small
// sizes: every row's key range, and the block ranges of both directions for several tile shapes; the
// policy compiled without windows (MaskPolicy<false>) on every case it serves, the one with windows on all.
// Built and run by tests/test_mask_policy.py; prints "ok <cases>" or the first mismatch and exits 1.
#include <cstdio>
#include <cstdlib>

#include "cuteflash/common/mask.h"

using cuteflash::BlockRange;
using cuteflash::kMaxSeqlen;

namespace {

long cases = 0;

template <typename MaskPolicy>
[[noreturn]] void fail(char const* what, MaskPolicy const& m, int block, int bm, int bn) {
  std::printf("MISMATCH %s: seqlen_q=%d seqlen_k=%d left=%d right=%d block=%d tile=%dx%d\n", what, m.seqlen_q,
              m.seqlen_k, m.left, m.right, block, bm, bn);
  std::exit(1);
}

// The brute-force mask: flash-attn's definition, written independently of the policy's arithmetic.
template <typename MaskPolicy>
bool visible(MaskPolicy const& m, int i, int j) {
  long diag = long(i) + m.seqlen_k - m.seqlen_q;
  return j >= diag - m.left && j <= diag + m.right;
}

// Checks one block range against the brute-force answer for every block index: visited[b] (some pair
// visible), whole[b] (every pair visible, and the block has no index past the end).
template <typename MaskPolicy>
void check_range(char const* what, MaskPolicy const& m, int block, int bm, int bn, BlockRange r, int n_blocks,
                 bool const* visited, bool const* whole) {
  bool any = false;
  for (int b = 0; b < n_blocks; ++b) any |= visited[b];
  if (!any) {
    if (!r.empty()) fail(what, m, block, bm, bn);
    return;
  }
  if (!(0 <= r.begin && r.begin <= r.unmasked_begin && r.unmasked_begin <= r.unmasked_end && r.unmasked_end <= r.end &&
        r.end <= n_blocks)) {
    fail(what, m, block, bm, bn);
  }
  for (int b = 0; b < n_blocks; ++b) {
    const bool in = b >= r.begin && b < r.end;
    if (in != visited[b]) fail(what, m, block, bm, bn);
    if (in && r.masked(b) == whole[b]) fail(what, m, block, bm, bn);
  }
}

// Whether some (row, key) pair of query block mb and key block nb is visible, and whether every pair is
// (rows below seqlen_q; a key block with keys past seqlen_k is never whole).
template <typename MaskPolicy>
void pair_stats(MaskPolicy const& m, int mb, int nb, int bm, int bn, bool& any, bool& all) {
  any = false;
  all = (nb + 1) * bn <= m.seqlen_k;
  for (int i = mb * bm; i < (mb + 1) * bm && i < m.seqlen_q; ++i) {
    for (int j = nb * bn; j < (nb + 1) * bn && j < m.seqlen_k; ++j) {
      any |= visible(m, i, j);
      all &= visible(m, i, j);
    }
  }
}

template <int kBlockM, int kBlockN, typename MaskPolicy>
void check_blocks(MaskPolicy const& m) {
  const int mq = (m.seqlen_q + kBlockM - 1) / kBlockM, nk = (m.seqlen_k + kBlockN - 1) / kBlockN;
  bool visited[64], whole[64];
  for (int mb = 0; mb < mq; ++mb) {  // the key blocks of each query block
    for (int nb = 0; nb < nk; ++nb) {
      pair_stats(m, mb, nb, kBlockM, kBlockN, visited[nb], whole[nb]);
      if (m.template block_masked<kBlockM, kBlockN>(mb, nb) == whole[nb]) fail("block_masked", m, mb, kBlockM, kBlockN);
    }
    check_range("key_blocks", m, mb, kBlockM, kBlockN, m.template key_blocks<kBlockM, kBlockN>(mb), nk, visited, whole);
    ++cases;
  }
  for (int nb = 0; nb < nk; ++nb) {  // the query blocks of each key block
    for (int mb = 0; mb < mq; ++mb) pair_stats(m, mb, nb, kBlockM, kBlockN, visited[mb], whole[mb]);
    check_range("query_blocks", m, nb, kBlockM, kBlockN, m.template query_blocks<kBlockM, kBlockN>(nb), mq, visited,
                whole);
    ++cases;
  }
}

template <typename MaskPolicy>
void check_rows(MaskPolicy const& m) {
  for (int i = 0; i < m.seqlen_q; ++i) {
    for (int j = 0; j < m.seqlen_k; ++j) {
      bool in_range = j >= m.key_begin(i) && j < m.key_end(i);
      if (in_range != visible(m, i, j) || m.visible(i, j) != visible(m, i, j)) fail("key range", m, i, 1, 1);
      bool in_rows = i >= m.row_begin(j) && i < m.row_end(j);
      if (in_rows != visible(m, i, j)) fail("row range", m, j, 1, 1);
    }
  }
  ++cases;
}

template <typename MaskPolicy>
void check_all(MaskPolicy const& m) {
  check_rows(m);
  check_blocks<1, 1>(m);
  check_blocks<4, 8>(m);
  check_blocks<8, 4>(m);
  check_blocks<16, 16>(m);
  check_blocks<3, 5>(m);
}

// Long sequences with unbounded sides: the arithmetic near kUnbounded must not overflow.
template <bool kWindow>
void check_long() {
  const int big = kMaxSeqlen - 1;
  for (int causal = 0; causal < 2; ++causal) {
    auto m = cuteflash::MaskPolicy<kWindow>::make(big, big, causal);
    if (m.key_begin(big - 1) != 0 || m.key_end(big - 1) != big || m.key_end(0) != (causal ? 1 : big) ||
        m.row_end(0) != big || m.row_begin(big - 1) != (causal ? big - 1 : 0)) {
      fail("long sequence", m, 0, 1, 1);
    }
    BlockRange r = m.template key_blocks<128, 128>(0);
    if (r.begin != 0 || r.end != (causal ? 1 : (big + 127) / 128)) fail("long sequence blocks", m, 0, 128, 128);
  }
}

}  // namespace

int main() {
  const int windows[] = {-1, 0, 1, 3, 8, 17};
  for (int sq = 1; sq <= 40; ++sq) {
    for (int sk = 1; sk <= 40; ++sk) {
      for (int causal = 0; causal < 2; ++causal) {
        for (int wl : windows) {
          for (int wr : windows) {
            if (causal && wr != -1) continue;  // causal fixes the right side
            check_all(cuteflash::MaskPolicy<true>::make(sq, sk, causal, wl, wr));
            if (wl == -1 && wr == -1) check_all(cuteflash::MaskPolicy<false>::make(sq, sk, causal));
          }
        }
      }
    }
  }
  check_long<true>();
  check_long<false>();
  std::printf("ok %ld cases\n", cases);
  return 0;
}
