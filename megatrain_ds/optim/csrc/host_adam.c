/* One pass of Adam/AdamW over a layer's host state: [Note: native host update] in megatrain_ds/host_update.py.
 *
 * Reads the gradient in the dtype it landed in (fp32, bf16 or fp16), reads and writes the master (fp32, or bf16 in
 * bf16-master mode) and the moments (fp32, or bf16: [Note: compact moments]) once, and writes the compute-dtype
 * wire copy (bf16 or fp16) when there is one, all in the same pass. The arithmetic is torch's fused CPU Adam kernel's, operation for operation, with the
 * same fused multiply-adds (compiled with -ffp-contract=off: only the fmaf() calls below fuse), so that the result
 * equals torch._fused_adamw_ on the same fp32 values (host_update.py says where this is checked and the bound).
 * Built at first use by host_update.py with the machine's C compiler; threads: POSIX, taking chunks (run_split).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

typedef struct {
    int64_t n;
    void *master; int master_dt;      /* fp32 or bf16 */
    const void *grad; int grad_dt;    /* fp32, bf16 or fp16 */
    void *exp_avg, *exp_avg_sq; int mom_dt; /* the Adam moments: fp32, or bf16 (compact optimizer state) */
    void *wire; int wire_dt;          /* NULL, bf16 or fp16 */
    float keep;                       /* AdamW: 1 - lr * weight_decay (rounded from double); 1 otherwise (exact) */
    float wd;                         /* Adam (L2): weight_decay */
    float beta1_w;                    /* lerp weight 1 - beta1 */
    float beta2, c2;                  /* beta2, 1 - beta2 */
    float neg_step_size, bc2_sqrt, eps;
    float grad_scale;                 /* divide the gradient by this (1: none; g / 1 is g, bit for bit) */
    int adamw;
    int64_t tail_from;                /* torch's vector loop stops here (n rounded down to its vector width) */
    int tail_form;                    /* how torch's build fused its scalar tail loop (tail_update) */
    int phase;                        /* PHASE_WHOLE, PHASE_WEIGHTS or PHASE_MOMENTS: [Note: deferred moments] */
} job_t;

/* [Note: deferred moments] in megatrain_ds/host_update.py: one update in two passes over the same values. WEIGHTS
 * computes the new moments exactly as WHOLE does but stores only the master and the wire copy; MOMENTS, later, from
 * the same gradient and moments, computes them again (the same operations, so the same bits) and stores only them.
 * AdamW only (Adam's L2 term reads the old master, which WEIGHTS has overwritten): host_update.native_adam refuses
 * the rest before it calls here. */
enum { PHASE_WHOLE = 0, PHASE_WEIGHTS = 1, PHASE_MOMENTS = 2 };

typedef struct { const void *job; int64_t begin, end; } range_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> quiet NaN (as torch) */
    uint32_t u; memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return isnan(f) ? (uint16_t)0x7FC0 : r;
}

static inline float load_val(const void *p, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

static inline void store_val(void *p, int dt, int64_t i, float v) {
    if (dt == DT_F32) ((float *)p)[i] = v;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((_Float16 *)p)[i] = (_Float16)v;
}

/* The element update, in torch's order: the loss-scale/clip division, the decay (AdamW: the master scaled first;
 * Adam: fma(p, wd, g)), exp_avg as lerp toward g with weight 1 - beta1 (fma(w, g - m, m) for w < 0.5, else
 * fma(w - 1, g - m, g)), exp_avg_sq = fma(c2 * g, g, v * beta2), denom = sqrt(v) / sqrt(bc2) + eps, and
 * p + (-step_size * m) / denom. */
#define ADAM_BODY(LOAD_P, LOAD_G, STORE_P, STORE_W, STORE_MV)                                  \
    for (int64_t i = r->begin; i < body_end; i++) {                                           \
        float g = LOAD_G / grad_scale;                                                     \
        float p = LOAD_P;                                                                     \
        g = l2 ? fmaf(p, wd, g) : g;                                                       \
        p = p * keep;                                                                      \
        float m = LOAD_M;                                                                     \
        m = fmaf(coeff, g - m, small ? m : g);                                                \
        float v = fmaf(c2 * g, g, LOAD_V * beta2);                                            \
        STORE_MV;                                                                             \
        float denom = sqrtf(v) / bc2_sqrt + eps;                                        \
        p = p + (neg_step_size * m) / denom;                                               \
        STORE_P; STORE_W;                                                                     \
    }

/* PHASE_MOMENTS: exp_avg and exp_avg_sq as ADAM_BODY forms them (AdamW: the gradient does not depend on the
 * master), stored; the master is not read. */
#define MOMENTS_BODY(LOAD_G)                                                                      \
    for (int64_t i = r->begin; i < body_end; i++) {                                           \
        float g = LOAD_G / grad_scale;                                                        \
        float m = LOAD_M;                                                                     \
        m = fmaf(coeff, g - m, small ? m : g);                                                \
        float v = fmaf(c2 * g, g, LOAD_V * beta2);                                            \
        STORE_M(m); STORE_V(v);                                                               \
    }

/* torch's scalar tail loop (the last n mod vector-width elements of a tensor): the same operations, which the
 * compiler that built torch fused differently, by build. ``tail_form`` says how (host_update.py's table, measured per
 * CPU dispatch by benchmarks/host_update_bench.py): bits 0-1 exp_avg_sq (0: fma(v, beta2, c2*g*g); 1: fma(c2*g, g,
 * v*beta2); 2: v*beta2 + c2*g*g), bit 2 Adam's L2 term unfused (g + p*wd), bit 3 exp_avg unfused (m + w*(g - m)). */
static void tail_update(const job_t *j, int64_t begin, int64_t end, float coeff, int small, int l2) {
    const int form = j->tail_form;
    for (int64_t i = begin; i < end; i++) {
        float g = load_val(j->grad, j->grad_dt, i) / j->grad_scale;
        float p = j->phase == PHASE_MOMENTS ? 0.0f : load_val(j->master, j->master_dt, i);
        if (l2) g = (form & 4) ? g + p * j->wd : fmaf(p, j->wd, g);
        p = p * j->keep;
        float m = load_val(j->exp_avg, j->mom_dt, i), v = load_val(j->exp_avg_sq, j->mom_dt, i);
        float base = small ? m : g;
        m = (form & 8) ? base + coeff * (g - m) : fmaf(coeff, g - m, base);
        switch (form & 3) {
            case 0: v = fmaf(v, j->beta2, j->c2 * g * g); break;
            case 1: v = fmaf(j->c2 * g, g, v * j->beta2); break;
            default: v = v * j->beta2 + j->c2 * g * g; break;
        }
        if (j->phase != PHASE_WEIGHTS) {
            store_val(j->exp_avg, j->mom_dt, i, m);
            store_val(j->exp_avg_sq, j->mom_dt, i, v);
        }
        if (j->phase == PHASE_MOMENTS) continue;
        p = p + (j->neg_step_size * m) / (sqrtf(v) / j->bc2_sqrt + j->eps);
        store_val(j->master, j->master_dt, i, p);
        if (j->wire) store_val(j->wire, j->wire_dt, i, p);
    }
}

#define ADAM_LOOPS(STORE_MV) \
    if (j->master_dt == DT_F32 && j->grad_dt == DT_F32 && !j->wire) { \
        float *restrict P = (float *)j->master; const float *restrict G = (const float *)j->grad; \
        ADAM_BODY(P[i], G[i], P[i] = p, (void)0, STORE_MV) \
    } else if (j->master_dt == DT_F32 && j->grad_dt == DT_BF16 && !j->wire) { \
        float *restrict P = (float *)j->master; const uint16_t *restrict G = (const uint16_t *)j->grad; \
        ADAM_BODY(P[i], bf16_to_f32(G[i]), P[i] = p, (void)0, STORE_MV) \
    } else if (j->master_dt == DT_F32 && j->grad_dt == DT_BF16 && j->wire_dt == DT_BF16) { \
        float *restrict P = (float *)j->master; const uint16_t *restrict G = (const uint16_t *)j->grad; \
        uint16_t *restrict W = (uint16_t *)j->wire; \
        ADAM_BODY(P[i], bf16_to_f32(G[i]), P[i] = p, W[i] = f32_to_bf16(p), STORE_MV) \
    } else if (j->master_dt == DT_F32 && j->grad_dt == DT_F32 && j->wire_dt == DT_BF16) { \
        float *restrict P = (float *)j->master; const float *restrict G = (const float *)j->grad; \
        uint16_t *restrict W = (uint16_t *)j->wire; \
        ADAM_BODY(P[i], G[i], P[i] = p, W[i] = f32_to_bf16(p), STORE_MV) \
    } else if (j->master_dt == DT_BF16 && j->grad_dt == DT_BF16 && !j->wire) { \
        uint16_t *restrict P = (uint16_t *)j->master; const uint16_t *restrict G = (const uint16_t *)j->grad; \
        ADAM_BODY(bf16_to_f32(P[i]), bf16_to_f32(G[i]), P[i] = f32_to_bf16(p), (void)0, STORE_MV) \
    } else { /* any other combination (fp16 gradients or wire, ...): the same arithmetic, per-element dtypes */ \
        void *P = j->master; const void *G = j->grad; \
        ADAM_BODY(load_val(P, j->master_dt, i), load_val(G, j->grad_dt, i), store_val(P, j->master_dt, i, p), \
                  if (j->wire) store_val(j->wire, j->wire_dt, i, p), STORE_MV) \
    }

/* The moment loads and stores of the loops above, by the moments' dtype: fp32, or bf16 (compact optimizer state:
 * read as fp32, the update computed in fp32 from the unrounded new moments, stored rounded to nearest even, as
 * torch's fused kernel on fp32 copies followed by a copy back). */
#define PHASES                                                                                         \
    if (j->phase == PHASE_MOMENTS) { /* the moments alone: the master and the wire copy are not touched */ \
        if (j->grad_dt == DT_F32) { const float *restrict G = (const float *)j->grad; MOMENTS_BODY(G[i]) }   \
        else if (j->grad_dt == DT_BF16) { const uint16_t *restrict G = (const uint16_t *)j->grad;          \
                                          MOMENTS_BODY(bf16_to_f32(G[i])) }                                 \
        else { const void *G = j->grad; MOMENTS_BODY(load_val(G, j->grad_dt, i)) }                         \
    } else if (j->phase == PHASE_WEIGHTS) {                                                             \
        ADAM_LOOPS((void)0)                                                                             \
    } else {                                                                                            \
        ADAM_LOOPS((STORE_M(m), STORE_V(v)))                                                            \
    }

static void *run_range(void *arg) {
    const range_t *r = (const range_t *)arg;
    const job_t *j = (const job_t *)r->job;
    int64_t body_end = r->end < j->tail_from ? r->end : j->tail_from;
    const float w = j->beta1_w;
    const int small = fabsf(w) < 0.5f;  /* the lerp's two forms, as torch picks them */
    const float coeff = small ? w : w - 1.0f;
    const int l2 = !j->adamw && j->wd != 0.0f;  /* Adam's L2 term; AdamW scales the master by keep (1 without decay) */
    /* the scalars in locals: the loops then read nothing through j, which a store might seem to alias */
    const float grad_scale = j->grad_scale, wd = j->wd, keep = j->keep, beta2 = j->beta2, c2 = j->c2;
    const float bc2_sqrt = j->bc2_sqrt, eps = j->eps, neg_step_size = j->neg_step_size;
    /* the common layouts get their own loops, so the compiler vectorizes them without per-element dtype tests */
    if (j->mom_dt == DT_BF16) {
        uint16_t *restrict mb_ = (uint16_t *)j->exp_avg, *restrict vb_ = (uint16_t *)j->exp_avg_sq;
#define LOAD_M bf16_to_f32(mb_[i])
#define LOAD_V bf16_to_f32(vb_[i])
#define STORE_M(x) (mb_[i] = f32_to_bf16(x))
#define STORE_V(x) (vb_[i] = f32_to_bf16(x))
        PHASES
#undef LOAD_M
#undef LOAD_V
#undef STORE_M
#undef STORE_V
    } else {
        float *restrict m_ = (float *)j->exp_avg, *restrict v_ = (float *)j->exp_avg_sq;
#define LOAD_M m_[i]
#define LOAD_V v_[i]
#define STORE_M(x) (m_[i] = (x))
#define STORE_V(x) (v_[i] = (x))
        PHASES
#undef LOAD_M
#undef LOAD_V
#undef STORE_M
#undef STORE_V
    }
    if (r->end > j->tail_from)
        tail_update(j, r->begin > j->tail_from ? r->begin : j->tail_from, r->end, coeff, small, l2);
    return NULL;
}

#define MAX_THREADS 256
#define MIN_PER_THREAD 65536
#define CHUNKS_PER_THREAD 8

/* The work of one call, handed out in chunks: each thread takes the next chunk until none is left. A thread that
 * the OS deschedules (the main thread issuing kernels, a CUDA driver thread, a DMA interrupt on its core) then holds
 * up one chunk, not a fixed 1/threads of the layer: with one static range per thread the call ended with its
 * slowest thread. */
typedef struct {
    const void *job; void *(*fn)(void *);
    int64_t n, chunk, next; /* next: the first element not yet taken (atomic) */
} split_t;

static void *take_chunks(void *arg) {
    split_t *s = (split_t *)arg;
    for (;;) {
        int64_t a = __atomic_fetch_add(&s->next, s->chunk, __ATOMIC_RELAXED);
        if (a >= s->n) return NULL;
        range_t r = {s->job, a, a + s->chunk < s->n ? a + s->chunk : s->n};
        s->fn(&r);
    }
}

/* Runs fn over [0, n) on up to ``threads`` threads (the caller one of them; no more than one per 64 Ki elements), in
 * chunks on cache lines (64 elements), about CHUNKS_PER_THREAD per thread and 16 Ki elements at least; if a thread
 * cannot be started, the others (the caller at least) take its chunks, so the work is always whole. */
static void run_split(int64_t n, int threads, const void *j, void *(*fn)(void *)) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* a small segment (a norm's weight, a bias) is not worth a thread start per 64 elements: 64 Ki elements each */
    if ((int64_t)threads > (n + MIN_PER_THREAD - 1) / MIN_PER_THREAD) threads = (int)((n + MIN_PER_THREAD - 1) / MIN_PER_THREAD);
    if (threads < 1) threads = 1;
    int64_t chunk = (n + (int64_t)threads * CHUNKS_PER_THREAD - 1) / ((int64_t)threads * CHUNKS_PER_THREAD);
    if (chunk < MIN_PER_THREAD / 4) chunk = MIN_PER_THREAD / 4;
    chunk = (chunk + 63) & ~(int64_t)63;
    split_t s = {j, fn, n, chunk, 0};
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, take_chunks, &s) == 0;
    take_chunks(&s);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], NULL);
}

/* Updates elements [0, n); elements from tail_from on as torch's scalar tail loop does them; ``phase``: the whole
 * update, or one of its two passes ([Note: deferred moments]). Returns 0; if a thread cannot be started, the others take its chunks (run_split), so the update is always whole. */
int megatrain_adam(int64_t n, void *master, int master_dt, const void *grad, int grad_dt, void *exp_avg,
                   void *exp_avg_sq, void *wire, int wire_dt, double lr, double beta1, double beta2,
                   double weight_decay, double eps, double step, float grad_scale, int adamw, int threads,
                   int64_t tail_from, int tail_form, int phase, int mom_dt) {
    job_t j;
    /* the scalars as torch's kernel forms them: in double, then rounded to float where they enter the math */
    double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
    double step_size = lr / bc1;
    j.n = n; j.master = master; j.master_dt = master_dt; j.grad = grad; j.grad_dt = grad_dt;
    j.exp_avg = exp_avg; j.exp_avg_sq = exp_avg_sq; j.mom_dt = mom_dt; j.wire = wire; j.wire_dt = wire_dt;
    j.keep = (adamw && weight_decay != 0.0) ? (float)(1.0 - lr * weight_decay) : 1.0f; j.wd = (float)weight_decay;
    j.beta1_w = (float)(1.0 - beta1); j.beta2 = (float)beta2; j.c2 = (float)(1.0 - beta2);
    j.neg_step_size = (float)(-step_size); j.bc2_sqrt = (float)sqrt(bc2); j.eps = (float)eps;
    j.grad_scale = grad_scale; j.adamw = adamw; j.tail_from = tail_from < 0 ? n : tail_from;
    j.tail_form = tail_form; j.phase = phase;
    run_split(n, threads, &j, run_range);
    return 0;
}


/* [Note: native rollback] in megatrain_ds/speculation.py: one speculative step undone from the new master and
 * moments and the gradient the step used, in double, speculation.adamw_undo's arithmetic operation for operation
 * (no fused multiply-adds), rounded to the fp32 state at the end, with the wire copy (bf16/fp16) written from the
 * restored master in the same pass. fp32 master only: bf16-master mode does not speculate. */
typedef struct {
    float *master, *exp_avg, *exp_avg_sq;
    const void *grad; int grad_dt;
    void *wire; int wire_dt;
    double step_size, bc2_sqrt, eps, keep, wd, c1, b1, c2, b2, grad_div;
    int adamw, divide;
} undo_job_t;

/* torch's clamp_min(v, 0): a negative v becomes +0, a NaN stays NaN. With a mask, not a branch or a select: GCC
 * would not if-convert a comparison that may trap, and the loop would not vectorize. */
static inline double clamp_min0(double v) {
    uint64_t bits, keep = (uint64_t)0 - (uint64_t)!(v < 0.0);
    memcpy(&bits, &v, 8); bits &= keep; memcpy(&v, &bits, 8);
    return v;
}

/* The element undo, in adamw_undo's order (double; -ffp-contract=off: no fused multiply-adds). ADAMW is a constant, so
 * each loop has no branch and vectorizes; the gradient is always divided (by 1.0 where the step did not scale it:
 * the same bits). */
#define UNDO_BODY(LOAD_G, STORE_W, ADAMW)                                                             \
    for (int64_t i = r->begin; i < r->end; i++) {                                                     \
        double p = P[i], m = M[i], v = V[i];                                                          \
        double g = (double)(LOAD_G) / grad_div;                                                       \
        double t = step_size * m;                                                                     \
        p = p + t / (sqrt(v) / bc2_sqrt + eps);                                                       \
        if (ADAMW) p = p / keep;                                                                      \
        else { double d = wd * p; g = g + d; }                                                        \
        double cg = c1 * g;                                                                           \
        m = (m - cg) / b1;                                                                            \
        double vg = c2 * g; vg = vg * g;                                                              \
        v = (v - vg) / b2;                                                                            \
        v = clamp_min0(v);                                                                            \
        float pf = (float)p;                                                                          \
        P[i] = pf; M[i] = (float)m; V[i] = (float)v;                                                  \
        STORE_W;                                                                                      \
    }
#define UNDO_BOTH(LOAD_G, STORE_W) \
    if (adamw) { UNDO_BODY(LOAD_G, STORE_W, 1) } else { UNDO_BODY(LOAD_G, STORE_W, 0) }

static void *undo_range(void *arg) {
    const range_t *r = (const range_t *)arg;
    const undo_job_t *u = (const undo_job_t *)r->job;
    float *restrict P = u->master, *restrict M = u->exp_avg, *restrict V = u->exp_avg_sq;
    const double step_size = u->step_size, bc2_sqrt = u->bc2_sqrt, eps = u->eps, keep = u->keep, wd = u->wd;
    const double c1 = u->c1, b1 = u->b1, c2 = u->c2, b2 = u->b2, grad_div = u->divide ? u->grad_div : 1.0;
    const int adamw = u->adamw;
    /* the common layouts get their own loops (vectorized without per-element dtype tests) */
    if (u->grad_dt == DT_BF16 && !u->wire) {
        const uint16_t *restrict G = (const uint16_t *)u->grad;
        UNDO_BOTH(bf16_to_f32(G[i]), (void)0)
    } else if (u->grad_dt == DT_BF16 && u->wire_dt == DT_BF16) {
        const uint16_t *restrict G = (const uint16_t *)u->grad; uint16_t *restrict W = (uint16_t *)u->wire;
        UNDO_BOTH(bf16_to_f32(G[i]), W[i] = f32_to_bf16(pf))
    } else if (u->grad_dt == DT_F32 && !u->wire) {
        const float *restrict G = (const float *)u->grad;
        UNDO_BOTH(G[i], (void)0)
    } else if (u->grad_dt == DT_F32 && u->wire_dt == DT_BF16) {
        const float *restrict G = (const float *)u->grad; uint16_t *restrict W = (uint16_t *)u->wire;
        UNDO_BOTH(G[i], W[i] = f32_to_bf16(pf))
    } else {
        const void *G = u->grad; void *W = u->wire; const int gdt = u->grad_dt, wdt = u->wire_dt;
        UNDO_BOTH(load_val(G, gdt, i), if (W) store_val(W, wdt, i, pf))
    }
    return NULL;
}

/* Undoes one step on elements [0, n): lr, betas, eps, weight decay and step as the step had them; grad_div: the
 * gradient was divided by it (0: not divided, coefficient 1). */
int megatrain_adam_undo(int64_t n, float *master, const void *grad, int grad_dt, float *exp_avg, float *exp_avg_sq,
                        void *wire, int wire_dt, double lr, double beta1, double beta2, double weight_decay,
                        double eps, double step, double grad_div, int adamw, int threads) {
    undo_job_t u;
    u.master = master; u.exp_avg = exp_avg; u.exp_avg_sq = exp_avg_sq; u.grad = grad; u.grad_dt = grad_dt;
    u.wire = wire; u.wire_dt = wire_dt;
    u.step_size = lr / (1.0 - pow(beta1, step)); u.bc2_sqrt = sqrt(1.0 - pow(beta2, step)); u.eps = eps;
    u.keep = 1.0 - lr * weight_decay; u.wd = weight_decay;
    u.c1 = 1.0 - beta1; u.b1 = beta1; u.c2 = 1.0 - beta2; u.b2 = beta2;
    u.grad_div = grad_div; u.divide = grad_div != 0.0; u.adamw = adamw;
    run_split(n, threads, &u, undo_range);
    return 0;
}
