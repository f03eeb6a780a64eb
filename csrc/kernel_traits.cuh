// Compile-time tile shapes of the kernels and their shared-memory layouts: FwdKernelTraits (the forward, dQ and
// decoding kernels) and BwdKernelTraits (the dK/dV kernel). Their template parameters are declared for the host in
// volta_train/kernels/templates.py (names, order, types, defaults; tests/test_kernel_templates.py holds the two alike).
//
// The forward: a CTA owns kBlockM query rows of one (batch, head) and walks the key blocks of kBlockN keys.
// Each warp owns kRowsPerWarp consecutive rows. Inside a warp the four quad-pairs of every
// m8n8k4 are arranged kQuadPairRows (along query rows) x kQuadPairCols (along keys in S = Q K^T,
// along head_dim in O = P V):
//   4 x 1: every quad-pair has its own 8 rows and all keys, so P never leaves its lanes
//          (used up to head_dim 96: O costs head_dim f32 registers per lane);
//   2 x 2: 16-row warps, half the output registers (head_dim / 2), but P must be exchanged
//          between the two quad-pairs of a row (one shuffle per register);
//   1 x 4: 8-row warps, a quarter of the output registers (head_dim / 4): the fewest registers per
//          thread, so the most resident warps; P is gathered from all four quad-pairs (three shuffles).
// kMTiles > 1 stacks more 8-row tiles per quad-pair so each K/V fragment read from shared memory
// feeds kMTiles tensor-core instructions.
#pragma once
#include "params.cuh"

__host__ __device__ constexpr int const_max(int a, int b) { return a > b ? a : b; }
// type_if<B, T, F>::type: T if B, else F.
template <bool B, class T, class F> struct type_if { using type = T; };
template <class T, class F> struct type_if<false, T, F> { using type = F; };
__host__ __device__ constexpr int const_log2(int n) { return n > 1 ? 1 + const_log2(n / 2) : 0; }
__host__ __device__ constexpr bool const_is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }
__host__ __device__ constexpr int const_trailing_zeros(int n) { return n > 0 && (n & 1) == 0 ? 1 + const_trailing_zeros(n / 2) : 0; }

// The backward's dQ block [block_m x head_dim] over `warps` warps, each owning `rows` (8, 16 or 32) queries and
// head_dim / col_warps columns, in quad-pairs of 8 rows: true when that tiles the block with a multiple of
// `tile_cols` columns per quad-pair.
__host__ __device__ constexpr bool dq_split_ok(int warps, int rows, int block_m, int head_dim, int tile_cols) {
    const int row_warps = block_m % rows == 0 ? block_m / rows : 0;
    const int col_warps = row_warps > 0 && warps % row_warps == 0 ? warps / row_warps : 0;
    return col_warps > 0 && head_dim % (col_warps * (32 / rows) * tile_cols) == 0;
}
// The fewest rows per warp (8, 16 or 32) with which `warps` warps tile the dQ block; 0: none does.
__host__ __device__ constexpr int dq_split_rows(int warps, int block_m, int head_dim, int tile_cols) {
    return dq_split_ok(warps, 8, block_m, head_dim, tile_cols)    ? 8
           : dq_split_ok(warps, 16, block_m, head_dim, tile_cols) ? 16
           : dq_split_ok(warps, 32, block_m, head_dim, tile_cols) ? 32 : 0;
}
// The most warps, up to `warps`, that tile the dQ block (the others skip dQ); 0: none.
__host__ __device__ constexpr int dq_split_warps(int warps, int block_m, int head_dim, int tile_cols) {
    return warps == 0 || dq_split_rows(warps, block_m, head_dim, tile_cols) > 0
               ? warps : dq_split_warps(warps - 1, block_m, head_dim, tile_cols);
}

// Layout of a shared-memory tile of rows (of halves, in 16-byte chunks): row r starts at half
//   offset(r) = r * PITCH + GAP1 * (r >> SHIFT1) + GAP2 * (r >> SHIFT2)
// The gaps (multiples of 8 halves, 0 for most tiles: plain padded rows) move rows that the two quad-pairs of a
// quarter-warp read at the same chunk onto other banks (docs/performance.md, "Shared-memory bank conflicts";
// lab/bank_model.py models every tile with the same formula). Every writer and reader of a tile
// computes its addresses with offset(); offset(a + b) == offset(a) + offset(b) whenever, for each nonzero gap,
// (a mod 2^SHIFT) + (b mod 2^SHIFT) < 2^SHIFT (e.g. b a multiple of every 2^SHIFT), which lets a reader add the
// offset of a compile-time step to a per-lane row base.
template <int PITCH, int SHIFT1 = 0, int GAP1 = 0, int SHIFT2 = 0, int GAP2 = 0>
struct TileRows {
    static constexpr int kPitch = PITCH;  // halves per row
    __host__ __device__ static constexpr int offset(int row) {
        return row * PITCH + GAP1 * (row >> SHIFT1) + GAP2 * (row >> SHIFT2);
    }
    __host__ __device__ static constexpr int bytes(int rows) { return rows > 0 ? 2 * (offset(rows - 1) + PITCH) : 0; }
    static_assert(PITCH % 8 == 0 && GAP1 % 8 == 0 && GAP2 % 8 == 0, "rows start on 16-byte chunks");
};

// A float vector of a query block (lse, dsum): element i at word index(i) = i + PAD * (i / 32); bytes() rounded
// to 16 so that the next tile stays 16-byte aligned.
template <int PAD>
struct TileVector {
    static constexpr int kPad = PAD;
    __host__ __device__ static constexpr int index(int i) { return i + PAD * (i >> 5); }
    __host__ __device__ static constexpr int bytes(int n) { return n > 0 ? (4 * (index(n - 1) + 1) + 15) / 16 * 16 : 0; }
};

// The smallest gap of whole chunks after every 8 rows that puts rows `rows_apart` apart (a multiple of 8) 4 chunks
// (64 bytes) apart modulo 128 bytes; 0 when none does.
__host__ __device__ constexpr int half_line_gap_chunks(int rows_apart, int g = 1) {
    return g > 7 ? 0 : ((rows_apart / 8) * g) % 8 == 4 ? g : half_line_gap_chunks(rows_apart, g + 1);
}

// The __launch_bounds__ occupancy target of the architecture being compiled: on sm_70 the V100's (kept
// spill-free by the CI report), on sm_80+ the emulated m8n8k4's (see below).
__host__ __device__ constexpr int launch_min_blocks(int sm70, int emulated) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return emulated;
#else
    return sm70;
#endif
}

// MIN_BLOCKS_PER_SM is the __launch_bounds__ occupancy target on sm_70 (kept spill-free by the CI report);
// MIN_BLOCKS_EMULATED the one on sm_80+, where m8n8k4 is an emulation subroutine whose latency only more
// resident warps hide (a few L1 spills cost less there than idle issue slots).
template <int HEAD_DIM, int QUAD_PAIR_ROWS, int M_TILES, int WARPS, int BLOCK_N, bool ACCUM_F16, bool DROPOUT,
          int MIN_BLOCKS_PER_SM = 1, int MIN_BLOCKS_EMULATED = 1, bool Q_IN_SMEM = false, bool SPLIT_MASKED_LOOP = false,
          bool SOFTCAP = false, bool SPLIT_KV = false, bool LAZY_RESCALE = false>
struct FwdKernelTraits {
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kQuadPairRows = QUAD_PAIR_ROWS;
    static constexpr int kQuadPairCols = 4 / QUAD_PAIR_ROWS;
    static constexpr int kPartners = kQuadPairCols - 1;              // quad-pairs that share a lane's rows
    static constexpr int kPartnerSlots = kPartners > 0 ? kPartners : 1;  // (no zero-length arrays)
    static constexpr int kMTiles = M_TILES;
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = 32 * WARPS;
    static constexpr int kMinBlocksPerSM = launch_min_blocks(MIN_BLOCKS_PER_SM, MIN_BLOCKS_EMULATED);
    static constexpr bool kAccumF16 = ACCUM_F16;
    static constexpr bool kDropout = DROPOUT;
    // Q in registers (head_dim / 2 per m-tile and lane, read once) or in shared memory (A fragments read
    // per use: more shared-memory traffic, fewer registers, so more resident warps).
    static constexpr bool kQInSmem = Q_IN_SMEM;
    // Masked key blocks in a loop of their own, where warps skip the blocks their rows cannot see (less
    // causal waste, more registers), or one loop for all blocks (see flash_fwd_kernel.cuh).
    static constexpr bool kSplitMaskedLoop = SPLIT_MASKED_LOOP;
    static constexpr bool kSoftcap = SOFTCAP;  // logit soft-capping (softcap.cuh)
    // The split-KV decoding kernel (params SplitKvParams): per-batch key lengths, a K/V batch map, key splits over
    // grid z with fp32 partial outputs; warps whose rows see none of a key block skip its tensor-core work. Only the
    // decoding tiles set it (volta_train/kernels/tiles.py DECODE_TILES_*).
    static constexpr bool kSplitKv = SPLIT_KV;
    using Params = typename type_if<SPLIT_KV, SplitKvParams, AttentionParams>::type;  // flash_fwd_kernel's parameter
    // The online softmax rescales O only where a key block raises a row's max by more than 2^8 (softmax.cuh,
    // OnlineSoftmax::kLazyRescaleLog2). fp32 accumulation only: the FP16-ACC forward keeps the exact rescale its
    // accuracy was measured with (tiles.fwd_variant passes LAZY_RESCALE for fp32 variants alone).
    static constexpr bool kLazyRescale = LAZY_RESCALE;
    static_assert(!LAZY_RESCALE || !ACCUM_F16, "lazy rescaling takes fp32 accumulation (ACCUM_F16 = false)");

    static constexpr int kRowsPerWarp = 8 * kQuadPairRows * kMTiles;
    static constexpr int kBlockM = kWarps * kRowsPerWarp;
    static constexpr int kBlockN = BLOCK_N;

    static constexpr int kKeyGroups = kBlockN / 8;                   // 8-key groups of a key block
    static constexpr int kSTilesPerQuadPair = kKeyGroups / kQuadPairCols;  // S tiles (8 keys) per quad-pair
    static constexpr int kOColsPerQuadPair = kHeadDim / kQuadPairCols;
    static constexpr int kOTilesPerQuadPair = kOColsPerQuadPair / 8;
    static constexpr int kOTilePairs = kOTilesPerQuadPair / 2;      // read with one 16-byte shared load
    static constexpr bool kOTileOdd = (kOTilesPerQuadPair % 2) != 0;
    static constexpr int kQRegs = kHeadDim / 2;                      // f16x2 registers per Q row

    static constexpr int kSmemStride = kHeadDim + 8;                 // halves: +16 B per row, no bank conflicts
    static constexpr int kVtStride = kBlockN + 8;                    // halves, same padding
    // The K block [key][head_dim] (the dQ kernel's K and V) and the V^T block [head_dim][key] (the dQ kernel's K^T).
    // In 1x4 tiles the two quad-pairs of a quarter-warp read B rows 8 * S-tiles apart at the same chunk (K, V): K / V
    // get 4 chunks (half a 128-byte line) after every 8 * S-tiles rows. They read V^T rows kOColsPerQuadPair apart at
    // key chunks S-tiles apart: with S-tiles odd, a pitch of C + 2 chunks (C even) puts one quad-pair's four rows on
    // chunks of one parity and the other's on the other, and one chunk more after every 4 rows keeps the transposed
    // writers' 8 consecutive rows apart. Other arrangements: plain rows.
    static constexpr bool k1x4Layout = kQuadPairRows == 1 && const_is_pow2(8 * kSTilesPerQuadPair);
    static constexpr bool k1x4VtLayout = kQuadPairRows == 1 && kSTilesPerQuadPair % 2 == 1;
    using KRows = TileRows<kSmemStride, const_log2(8 * kSTilesPerQuadPair), k1x4Layout ? 32 : 0>;
    using VtRows = TileRows<kVtStride + (k1x4VtLayout ? 8 : 0), 2, k1x4VtLayout ? 8 : 0>;
    static constexpr int kTileBytes = KRows::bytes(kBlockN);         // K block
    static constexpr int kVtTileBytes = VtRows::bytes(kHeadDim);     // V block transposed
    // The Q tile (the forward's; the dQ kernel's Q and dO tiles), A operands when kQInSmem: in 2x2 tiles the two
    // quad-pairs of a quarter-warp read rows 8 apart, so rows 8, 24, 40, ... start 4 chunks later (as
    // BwdKernelTraits::KvRows); other arrangements read rows 16 or more apart and keep plain rows. The split masked
    // loop (an sm_80+ causal tile only) keeps plain rows too: the gaps' address arithmetic makes it spill on sm_90.
    static constexpr int kQGap = kQInSmem && kQuadPairRows == 2 && !kSplitMaskedLoop ? 32 : 0;
    using QRows = TileRows<kSmemStride, 3, kQGap, 4, -kQGap>;
    static constexpr int kQTileBytes = kQInSmem ? QRows::bytes(kBlockM) : 0;  // after K and V^T
    // The epilogue's staging tile of O (the dQ kernel's dQ), reusing the start: plain padded rows. Each quarter-warp
    // stores 8 consecutive rows of one column (stage_acc_tile_row's staging lanes, mma_sm70.cuh) and the drain reads
    // 8 chunks of one row or one chunk of 8 rows (tile_chunk_position): with an odd pitch in chunks, conflict-free.
    using OStageRows = TileRows<kSmemStride>;
    static constexpr int kOStageBytes = OStageRows::bytes(kBlockM);
    static constexpr int kSmemBytes = const_max(kTileBytes + kVtTileBytes + kQTileBytes, kOStageBytes);
    static constexpr int kChunksPerRow = kHeadDim / 8;               // 16-byte chunks per row
    static constexpr int kTileChunks = kBlockN * kChunksPerRow;
    static constexpr int kChunksPerThread = (kTileChunks + kThreads - 1) / kThreads;

    static_assert(QUAD_PAIR_ROWS == 4 || QUAD_PAIR_ROWS == 2 || QUAD_PAIR_ROWS == 1,
                  "quad-pairs are arranged 4x1, 2x2 or 1x4");
    static_assert(kHeadDim % (8 * kQuadPairCols) == 0, "head_dim must split evenly over the quad-pair columns");
    static_assert(kKeyGroups % kQuadPairCols == 0, "key groups must split evenly over the quad-pair columns");
    static_assert(kSmemBytes <= 96 * 1024, "a V100 block has at most 96 KB of shared memory");
};

// Tile shapes of the backward dK/dV kernel. A CTA owns kBlockN keys of one (batch, kv head) and walks the
// query blocks of kBlockM queries of every query head of its group. Roles are swapped with respect to the
// forward: warps own keys (rows of S^T = K Q^T and dP^T = V dO^T), quad-pairs are arranged
// kQuadPairRows (along keys) x kQuadPairCols (along queries in S^T, along head_dim in dK and dV).
// dQ = dS K is computed by the first kDqWarps warps from dS in shared memory, each owning kDqRowsPerWarp queries, and
// added into an fp32 buffer with atomics (DQ_ATOMIC; the deterministic path computes dQ in its own kernel).
// OUT_SPLIT > 1: OUT_SPLIT CTAs (blockIdx.z, the slice) share one key block, each accumulating kOutDim =
// head_dim / OUT_SPLIT columns of dK and dV; every one of them computes the full S^T and dP^T (head_dim 256,
// whose dK / dV accumulators do not fit one CTA's registers; docs/performance.md, "head_dim 256").
template <int HEAD_DIM, int QUAD_PAIR_ROWS, int WARPS, int BLOCK_M, bool ACCUM_F16, bool DROPOUT, bool DQ_ATOMIC,
          bool KV_IN_SMEM = false, int MIN_BLOCKS_PER_SM = 1, int MIN_BLOCKS_EMULATED = 1, bool LEAN = false,
          bool SOFTCAP = false, int OUT_SPLIT = 1, bool DQ_FROM_K = false, bool DKDV_ROW_B = false>
struct BwdKernelTraits {
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kQuadPairRows = QUAD_PAIR_ROWS;
    static constexpr int kQuadPairCols = 4 / QUAD_PAIR_ROWS;
    static constexpr int kPartners = kQuadPairCols - 1;
    static constexpr int kPartnerSlots = kPartners > 0 ? kPartners : 1;
    static constexpr int kMTiles = 1;
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = 32 * WARPS;
    static constexpr int kMinBlocksPerSM = launch_min_blocks(MIN_BLOCKS_PER_SM, MIN_BLOCKS_EMULATED);
    static constexpr bool kAccumF16 = ACCUM_F16;
    static constexpr bool kDropout = DROPOUT;
    static constexpr bool kDqAtomic = DQ_ATOMIC;
    static constexpr bool kKvInSmem = KV_IN_SMEM;  // K, V as A operands from shared memory (else registers)
    // Register-lean variant (the sm_70 2x2 tiles of head_dim 96/128, whose dK/dV accumulators take 96-128
    // registers per lane): per-query-block recomputation of addresses, head pointers and Philox keys, and dK/dV
    // products accumulated in fp32 in both modes (see flash_bwd_kernel.cuh). Off: every other tile is unchanged.
    static constexpr bool kLean = LEAN;
    static constexpr bool kSoftcap = SOFTCAP;  // logit soft-capping (softcap.cuh)
    // dV += P^T dO and dK += dS^T Q as fp16-accumulating products (FP16-ACC, not lean): the block's partial sums
    // then sit in the f16 accumulator layout (row operand_row(), 8 consecutive columns), else the f32 one.
    static constexpr bool kDkDvF16Products = ACCUM_F16 && !LEAN;

    static constexpr int kRowsPerWarp = 8 * kQuadPairRows;   // keys per warp
    static constexpr int kBlockN = kWarps * kRowsPerWarp;    // keys per CTA
    static constexpr int kBlockM = BLOCK_M;                  // queries per iteration
    static constexpr int kSTilesPerQuadPair = kBlockM / 8 / kQuadPairCols;
    static constexpr int kOutSplit = OUT_SPLIT;
    static constexpr int kOutDim = kHeadDim / kOutSplit;     // dK / dV columns of one CTA (its slice)
    static constexpr int kOColsPerQuadPair = kOutDim / kQuadPairCols;  // dK / dV columns per quad-pair
    static constexpr int kOTilesPerQuadPair = kOColsPerQuadPair / 8;
    static constexpr int kQRegs = kHeadDim / 2;

    // dQ by atomics with B = the K tile's rows (row-major B, DQ_FROM_K) instead of a K^T copy: no K^T tile in
    // shared memory (what lets the sm_70 d128 tile fit 96 KB).
    static constexpr bool kDqFromK = DQ_FROM_K && DQ_ATOMIC;
    // dV += P^T dO and dK += dS^T Q with B = the Q / dO tiles' rows (row-major B, DKDV_ROW_B) instead of Q^T / dO^T
    // copies: the query block is stored once, untransposed. One 16-byte load of a Q / dO row feeds a pair of 8-column
    // output tiles, whose logical column c of tile 2j + e is the quad-pair's column 16 j + 8 (c >> 2) + 4 e + (c & 3),
    // and quad-pair q owns the dK / dV columns of slot (q & 1) * 2 + (q >> 1) (conflict-free reads, below).
    static constexpr bool kDkDvRowB = DKDV_ROW_B;
    // dQ's atomics through two row pointers with immediate offsets and no branches (flash_bwd_kernel.cuh), on the
    // tiles that take dQ from the K tile (the sm_70 d112/d128 tile, which it was designed for). The emulated tiles keep
    // a branch per row pair: there the branch-free form spilled under the 128-register cap or ran slower on sm_90.
    static constexpr bool kDqRowPointers = kDqFromK;
    // dQ tile [kBlockM x head_dim], arranged like a forward output tile over the first kDqWarps warps: the most warps
    // that tile it with 8-column tiles (pairs of them with kDqFromK), in as few rows per warp as they can (a 12-warp
    // d64 or d128 CTA's dQ runs on 8 warps of 8 queries, d96's from the K tile on 6 warps of 16; the others skip it):
    // warp w owns kDqRowsPerWarp queries and kDqColsPerWarp columns, kDqColWarps warps sharing a row range.
    static constexpr int kDqWarps = const_max(1, dq_split_warps(kWarps, kBlockM, kHeadDim, kDqFromK ? 16 : 8));
    static constexpr int kDqColWarps =
        const_max(1, kDqWarps * const_max(8, dq_split_rows(kDqWarps, kBlockM, kHeadDim, kDqFromK ? 16 : 8)) / kBlockM);
    static constexpr int kDqRowWarps = kDqWarps / kDqColWarps;
    static constexpr int kDqRowsPerWarp = kBlockM / kDqRowWarps;
    static constexpr int kDqColsPerWarp = kHeadDim / kDqColWarps;
    static constexpr int kDqQuadPairRows = kDqRowsPerWarp / 8;
    static constexpr int kDqQuadPairCols = kDqQuadPairRows > 0 ? 4 / kDqQuadPairRows : 1;
    static constexpr int kDqColsPerQuadPair = kDqColsPerWarp / kDqQuadPairCols;
    static constexpr int kDqTilesPerQuadPair = kDqColsPerQuadPair / 8;

    // Shared memory (halves; rows padded by 16 B). Layouts (TileRows, TileVector above; mirrored by
    // lab/bank_model.py bwd_layouts; the launch takes kSmemBytes from the compiled kernel, launch_geometry.cuh):
    // 1x4 tiles: the two quad-pairs of a quarter-warp read the B rows of S^T (Q, dO) 8 * S-tiles rows apart, the rows
    //   of dK's / dV's B (Q^T, dO^T) kOColsPerQuadPair rows apart at chunks S-tiles apart, lse / dsum 8 * S-tiles
    //   queries apart, and store dS 8 * S-tiles rows apart: Q / dO get 4 chunks after every 8 * S-tiles rows; lse /
    //   dsum 4 words after every 32; dS 4 chunks after every 8 * S-tiles rows (8 * S-tiles a power of two). Q^T /
    //   dO^T: a pitch of C + 2 chunks (C even) puts a quad's four rows on chunks of one parity, one chunk more after
    //   every 4 rows flips it for the next four (the transposed writers store 8 rows), and the partner quad-pair's
    //   rows land on the other parity when kOColsPerQuadPair / 4 + S-tiles is odd; else one more chunk after every
    //   2^z rows, z the trailing zeros of kOColsPerQuadPair (an odd count of them between the partners).
    // dQ atomics on 1x4 dQ quad-pairs (8 queries per warp): K^T rows kDqColsPerQuadPair apart, a gap every 8 rows.
    // dQ from the K tile (1x4 K rows, a pitch of 4 words modulo 32): quad-pair q takes column slot (q & 1) * 2 +
    //   (q >> 1) of the warp's columns, so that the two quad-pairs of a quarter-warp read their 4 K rows 64 bytes
    //   apart; 2x2 dQ quad-pairs: the two of a quarter-warp share their columns (one row range each), so they read the
    //   same K words (a broadcast), and q takes slot q >> 1.
    // Other tiles: plain rows (gaps 0).
    static constexpr int kSRowsApart = 8 * kSTilesPerQuadPair;  // rows between quad-pairs of a quarter-warp
    static constexpr bool k1x4Layout = kQuadPairRows == 1 && const_is_pow2(kSRowsApart);
    static constexpr bool kQtPartnerGap = kQuadPairRows == 1 && (kOColsPerQuadPair / 4 + kSTilesPerQuadPair) % 2 == 0;
    using QRows = TileRows<kHeadDim + 8, const_log2(kSRowsApart), k1x4Layout ? 32 : 0>;  // Q, dO [query][head_dim]
    using QtRows = TileRows<kBlockM + (kQuadPairRows == 1 ? 16 : 8), 2, kQuadPairRows == 1 ? 8 : 0,  // Q^T, dO^T
                            const_trailing_zeros(kOColsPerQuadPair), kQtPartnerGap ? 8 : 0>;   // [kOutDim][query]
    // 2x2 tiles with K / V in shared memory (A operands): the two quad-pairs of a quarter-warp read K / V rows 8
    //   apart (the warp's two 8-key tiles) and store dS at key chunks c, c + 1: K / V get 4 chunks before rows 8,
    //   24, 40, ... (4 * ((r >> 3) - (r >> 4)): the second 8-row tile of every 16 rows moves half a 128-byte line;
    //   no gap where no quad-pair pair straddles, so d112's tiles fit 2 CTAs per SM); dS a pitch of C + 2 chunks.
    static constexpr bool k2x2SmemLayout = kQuadPairRows == 2 && kKvInSmem;
    using KtRows = TileRows<kBlockN + 8, 3,  // K^T [head_dim][key]
                            (k1x4Layout || k2x2SmemLayout) && kDqQuadPairRows == 1
                                ? 8 * half_line_gap_chunks(kDqColsPerQuadPair) : 0>;
    using DsRows = TileRows<kBlockN + (k2x2SmemLayout ? 16 : 8), const_log2(kSRowsApart),  // dS [query][key]
                            k1x4Layout ? 32 : 0>;
    using KvRows = TileRows<kHeadDim + 8, 3, k2x2SmemLayout ? 32 : 0, 4, k2x2SmemLayout ? -32 : 0>;  // K, V
    using Vector = TileVector<k1x4Layout ? 4 : 0>;                                          // lse, dsum
    static constexpr int kRowStride = kOutDim + 8;     // halves: the dK / dV staging tile (plain rows)
    static constexpr int kQTileBytes = QRows::bytes(kBlockM);
    static constexpr int kQtTileBytes = kDkDvRowB ? 0 : QtRows::bytes(kOutDim);  // the slice's columns of Q / dO, transposed
    static constexpr int kKtTileBytes = KtRows::bytes(kHeadDim);
    static constexpr int kDsTileBytes = DsRows::bytes(kBlockM);
    static constexpr int kKvTileBytes = kKvInSmem ? KvRows::bytes(kBlockN) : 0;
    static constexpr int kVectorBytes = Vector::bytes(kBlockM);  // lse (log2 domain) or dsum of a query block
    static constexpr int kOffQ = 0;
    static constexpr int kOffDo = kOffQ + kQTileBytes;
    static constexpr int kOffQt = kOffDo + kQTileBytes;
    static constexpr int kOffDot = kOffQt + kQtTileBytes;
    static constexpr int kOffKt = kOffDot + kQtTileBytes;
    static constexpr int kOffDs = kOffKt + (kDqAtomic && !kDqFromK ? kKtTileBytes : 0);
    static constexpr int kOffK = kOffDs + (kDqAtomic ? kDsTileBytes : 0);
    static constexpr int kOffV = kOffK + kKvTileBytes;
    static constexpr int kOffLse = kOffV + kKvTileBytes;
    static constexpr int kOffDsum = kOffLse + kVectorBytes;
    static constexpr int kOStageBytes = kBlockN * kRowStride * 2;  // dK / dV staging at the end
    static constexpr int kSmemBytes = const_max(kOffDsum + kVectorBytes, kOStageBytes);

    static constexpr int kChunksPerRow = kHeadDim / 8;
    static constexpr int kOutChunksPerRow = kOutDim / 8;  // of dK / dV rows
    static constexpr int kQTileChunks = kBlockM * kChunksPerRow;
    static constexpr int kChunksPerThread = (kQTileChunks + kThreads - 1) / kThreads;

    static_assert(QUAD_PAIR_ROWS == 2 || QUAD_PAIR_ROWS == 1, "backward quad-pairs are arranged 2x2 or 1x4");
    static_assert(kBlockM % (8 * kQuadPairCols) == 0, "query block must split over the quad-pair columns");
    static_assert(kHeadDim % (8 * kQuadPairCols * kOutSplit) == 0, "head_dim must split over the quad-pair columns");
    static_assert(kOutSplit == 1 || !kDqAtomic, "split dK / dV tiles take dQ from the dQ kernel (no atomics)");
    // (the loaders transpose only the slice's columns, in warp-uniform branches: whole groups of 4 chunks)
    static_assert(kOutSplit == 1 || (kOutChunksPerRow % 4 == 0 && kChunksPerRow % 4 == 0),
                  "a dK / dV slice must be a multiple of 32 columns");
    static_assert(!kDqAtomic || (kDqQuadPairRows == 1 || kDqQuadPairRows == 2 || kDqQuadPairRows == 4),
                  "dQ rows per warp must be 8, 16 or 32");
    static_assert(!kDqAtomic || kHeadDim % (8 * kDqQuadPairCols * kDqColWarps) == 0,
                  "head_dim must split over dQ quad-pairs");
    static_assert(!kDqAtomic || kDqColWarps * kDqRowWarps == kDqWarps, "dQ's warps must tile the query block");
    static_assert(!kDqFromK || (kKvInSmem && kDqQuadPairCols >= 2 && kDqTilesPerQuadPair % 2 == 0),
                  "dQ from the K tile needs K in shared memory, 1x4 or 2x2 dQ quad-pairs and pairs of 8-column tiles");
    static_assert(!kDkDvRowB || (kQuadPairRows == 1 && k1x4Layout && kOutSplit == 1 && kOTilesPerQuadPair % 2 == 0),
                  "dK / dV from Q / dO rows needs 1x4 quad-pairs, their Q / dO layout, no split and pairs of 8-column tiles");
    // (sm_70 builds only: the emulated tiles of sm_80+, where an SM has 227 KB, may take more; the d128 one does)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(kSmemBytes <= 96 * 1024, "a V100 block has at most 96 KB of shared memory");
#endif
};
