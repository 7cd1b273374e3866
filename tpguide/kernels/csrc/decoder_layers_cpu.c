/* A Llama-shape decoder stack in one call: the kernels of fixed_order_cpu.c in the order the Python
 * layers call them, without a trip through Python and torch between them.
 * Included at the end of fixed_order_cpu.c (one library); the Python side is
 * tpguide/kernels/decoder_layers_cpu.py, the design docs/architecture.md §6 "The decoder stack in one call".
 *
 * Per layer, with h / residual the model dtype (0 fp32, 2 bf16), [T, hidden]:
 *   h, residual = add_rms_norm(h, residual, input_norm)          (tpguide_add_rms_norm; the first layer
 *                                                                  has no residual: it becomes h)
 *   qkv   = linear(h, W_qkv)                                     (one unit, stored in the model dtype)
 *   q, kc = rotary(q, k, cos, sin), k and v written to the cache  (tpguide_rotary)
 *   a     = attention(q, cache)                                  (tpguide_attention, model dtype)
 *   o     = linear(a, W_o), one unit per head, units added in order
 *   h, residual = add_rms_norm(o, residual, post_norm)
 *   m     = act_and_mul(linear(h, W_gate_up))                    (tpguide_act_and_mul)
 *   h     = linear(m, W_down), its reduction units added in order
 * Each step is the exported kernel the per-op path calls with the same inputs, so every value is
 * the per-op path's bit for bit.  A linear is the fmaf-chain kernel (fp32 x: a bf16 input widened
 * exactly) or the VDPBF16PS pair kernel (bf16 x, each unit zero-padded to K_pad). */

struct tpguide_linear_desc {
    const void *panels;
    int64_t kind; /* 0: tpguide_linear_units (fmaf), 1: tpguide_linear_units_pairs (VDPBF16PS) */
    int64_t w_dtype, unit_size, k_pad, units, out_features;
};

struct tpguide_layer_desc {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    struct tpguide_linear_desc qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t num_blocks;
    const void *cos, *sin; /* [T, R] of the model dtype, this step's rows */
    int64_t rotary_dim, window, act_op;
    float scale, softcap;
};

struct tpguide_stack_step {
    int64_t T, dtype, hidden, heads, kv_heads, head_dim, intermediate;
    const int64_t *slots;        /* [T] cache rows */
    const int64_t *block_tables; /* [num_seqs, max_blocks] */
    int64_t num_seqs, max_blocks, block_size;
    const int64_t *token_seq, *token_pos; /* [T] */
    int64_t max_seq_len;
    float *attention_scratch;
    void *work; /* tpguide_stack_work_bytes(...) bytes */
    int64_t threads, elements_per_thread;
};

static int64_t elem_threads(const struct tpguide_stack_step *s, int64_t elements) {
    int64_t n = elements / s->elements_per_thread;
    return n < 1 ? 1 : (n > s->threads ? s->threads : n);
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* The step's intermediates, carved out of s->work in this order (the model dtype): qkv, rotated q,
 * attention out, normed, o, gate_up, act; then, 64-byte aligned, xbuf: the widened (fp32) or padded
 * input of a linear. */
struct stack_buffers {
    void *qkv, *q_rot, *attn, *normed, *o, *gate_up, *act, *xbuf;
};

static struct stack_buffers carve(const struct tpguide_stack_step *s) {
    const int64_t T = s->T, esize = s->dtype == 0 ? 4 : 2;
    const int64_t hd = s->heads * s->head_dim, qkv_w = hd + 2 * s->kv_heads * s->head_dim;
    struct stack_buffers b;
    char *w = (char *)(((uintptr_t)s->work + 63) & ~(uintptr_t)63);
    b.qkv = w;
    w += T * qkv_w * esize;
    b.q_rot = w;
    w += T * hd * esize;
    b.attn = w;
    w += T * hd * esize;
    b.normed = w;
    w += T * s->hidden * esize;
    b.o = w;
    w += T * s->hidden * esize;
    b.gate_up = w;
    w += 2 * T * s->intermediate * esize;
    b.act = w;
    w += T * s->intermediate * esize;
    b.xbuf = (void *)(((uintptr_t)w + 63) & ~(uintptr_t)63);
    return b;
}

/* Bytes of s->work for a step of these sizes: carve's layout from address 0, the widest linear input
 * as fp32 in xbuf (widest_padded_input: the widest units * K_pad), and 128 bytes for the two
 * alignments of a real base address. */
int64_t tpguide_stack_work_bytes(int64_t T, int64_t dtype, int64_t hidden, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t intermediate, int64_t widest_padded_input) {
    struct tpguide_stack_step s = {0};
    s.T = T, s.dtype = dtype, s.hidden = hidden, s.heads = heads, s.kv_heads = kv_heads, s.head_dim = head_dim;
    s.intermediate = intermediate; /* work stays NULL: the layout's offsets */
    const int64_t x_floats = max3(max3(hidden, heads * head_dim, intermediate), widest_padded_input, 1);
    return (int64_t)(uintptr_t)carve(&s).xbuf + 4 * T * x_floats + 128;
}

/* out = linear(x [T, U * unit_size] of the model dtype): sum_units != 0: [T, N] of the model dtype, the
 * units added in order; 0: fp32 [U, T, N], one partial per unit (for the row-parallel sum across ranks).
 * xbuf: scratch for a widened or padded x. */
static int stack_linear(const struct tpguide_linear_desc *w, const void *x, int64_t T, int64_t dtype, void *xbuf,
                        void *out, int64_t sum_units, int64_t threads) {
    const int64_t K = w->unit_size * w->units, out_dtype = sum_units ? dtype : 0;
    if (w->kind == 0) {
        const float *xf = (const float *)x;
        if (dtype == 2) { /* x.float(): exact */
            float *dst = (float *)xbuf;
            const uint16_t *src = (const uint16_t *)x;
            for (int64_t i = 0; i < T * K; i++) dst[i] = bf16_to_f32(src[i]);
            xf = dst;
        }
        return tpguide_linear_units(xf, T, K, w->panels, w->w_dtype, w->unit_size, w->units, w->out_features, out,
                                    out_dtype, sum_units, threads);
    }
    if (dtype != 2) return -1; /* pairs take bf16 x */
    const uint16_t *xb = (const uint16_t *)x;
    if (w->k_pad != w->unit_size) { /* each unit zero-padded to K_pad */
        uint16_t *dst = (uint16_t *)xbuf;
        for (int64_t t = 0; t < T; t++)
            for (int64_t u = 0; u < w->units; u++) {
                uint16_t *d = dst + (t * w->units + u) * w->k_pad;
                memcpy(d, xb + t * K + u * w->unit_size, sizeof(uint16_t) * (size_t)w->unit_size);
                memset(d + w->unit_size, 0, sizeof(uint16_t) * (size_t)(w->k_pad - w->unit_size));
            }
        xb = dst;
    }
    return tpguide_linear_units_pairs(xb, T, w->units * w->k_pad, (const uint16_t *)w->panels, w->k_pad, w->units,
                                      w->out_features, out, out_dtype, sum_units, PAIR_VDPBF16PS, 0, threads);
}

/* The attention half of a layer: residual add + norm, qkv, RoPE with the cache write, attention, o_proj
 * into out (partials != 0: fp32 unit partials, else the model dtype, units added).  first: x is the
 * first layer's input without a residual (h = norm(x), then residual = x).  Returns 0 or the failing
 * step (1..5). */
static int attention_half(const struct tpguide_layer_desc *L, const struct tpguide_stack_step *s,
                          const struct stack_buffers *b, const void *x, void *residual, int first, void *out,
                          int64_t partials) {
    const int64_t T = s->T, dt = s->dtype, esize = dt == 0 ? 4 : 2;
    const int64_t hd = s->heads * s->head_dim, kvd = s->kv_heads * s->head_dim, qkv_w = hd + 2 * kvd;
    if (tpguide_add_rms_norm(x, first ? NULL : residual, L->input_norm, dt, T, s->hidden, L->input_eps, b->normed,
                             first ? NULL : residual, elem_threads(s, T * s->hidden)))
        return 1;
    if (first) memcpy(residual, x, (size_t)(T * s->hidden * esize)); /* a bit copy: residual = x */
    if (stack_linear(&L->qkv, b->normed, T, dt, b->xbuf, b->qkv, 1, s->threads)) return 2;
    const char *qp = (const char *)b->qkv;
    if (tpguide_rotary(qp, qkv_w, s->head_dim, qp + hd * esize, qkv_w, s->head_dim, qp + (hd + kvd) * esize, qkv_w,
                       s->head_dim, dt, T, s->heads, s->kv_heads, s->head_dim, L->rotary_dim, L->cos, L->sin,
                       b->q_rot, L->k_cache, L->v_cache, s->slots, L->num_blocks * s->block_size,
                       elem_threads(s, T * (s->heads + 2 * s->kv_heads) * s->head_dim)))
        return 3;
    if (tpguide_attention(b->q_rot, L->k_cache, L->v_cache, dt, s->block_tables, s->num_seqs, s->max_blocks,
                          s->block_size, L->num_blocks, s->token_seq, s->token_pos, T, s->heads, s->kv_heads,
                          s->head_dim, s->max_seq_len, L->scale, L->window, L->softcap, s->attention_scratch, b->attn,
                          dt, s->threads))
        return 4;
    return stack_linear(&L->o, b->attn, T, dt, b->xbuf, out, !partials, s->threads) ? 5 : 0;
}

/* The MLP half: residual add + norm of o (the attention half's output, the model dtype), gate_up,
 * act_and_mul, down_proj into out (as attention_half's).  Returns 0 or the failing step (6..9). */
static int mlp_half(const struct tpguide_layer_desc *L, const struct tpguide_stack_step *s,
                    const struct stack_buffers *b, const void *o, void *residual, void *out, int64_t partials) {
    const int64_t T = s->T, dt = s->dtype;
    if (tpguide_add_rms_norm(o, residual, L->post_norm, dt, T, s->hidden, L->post_eps, b->normed, residual,
                             elem_threads(s, T * s->hidden)))
        return 6;
    if (stack_linear(&L->gate_up, b->normed, T, dt, b->xbuf, b->gate_up, 1, s->threads)) return 7;
    if (tpguide_act_and_mul(b->gate_up, 2 * s->intermediate, dt, T, s->intermediate, L->act_op, b->act,
                            elem_threads(s, T * s->intermediate)))
        return 8;
    return stack_linear(&L->down, b->act, T, dt, b->xbuf, out, !partials, s->threads) ? 9 : 0;
}

/* Runs n_layers layers (tp 1: every unit on this rank, added in order).  hidden: [T, hidden] the first
 * layer's input, overwritten with the last layer's MLP output; residual: [T, hidden], read if
 * has_residual (else the first layer's input becomes it), overwritten with the residual beside the
 * output (their sum is the stack's output, as LlamaModel.forward carries it).  Returns 0, or
 * layer * 16 + step (1..9) of the kernel call that refused its arguments; the caller then runs the
 * per-op path, which names the bad value. */
int tpguide_decoder_layers(const struct tpguide_layer_desc *layers, int64_t n_layers,
                           const struct tpguide_stack_step *s, void *hidden, void *residual, int64_t has_residual) {
    const struct stack_buffers b = carve(s);
    for (int64_t i = 0; i < n_layers; i++) {
        int step = attention_half(layers + i, s, &b, hidden, residual, i == 0 && !has_residual, b.o, 0);
        if (!step) step = mlp_half(layers + i, s, &b, b.o, residual, hidden, 0);
        if (step) return (int)(i * 16 + step);
    }
    return 0;
}

/* One half of one layer at tp > 1, its row-parallel output as fp32 unit partials [U_local, T, N] in
 * partials (the caller adds the units in order across ranks between the halves, sum_units).
 * half 0: attention (x = the layer's input; first as attention_half); half 1: MLP (x = the summed
 * o_proj output, the model dtype).  residual as tpguide_decoder_layers.  Returns 0 or the failing step. */
int tpguide_decoder_half(const struct tpguide_layer_desc *layer, const struct tpguide_stack_step *s, int64_t half,
                         const void *x, void *residual, int64_t first, float *partials) {
    const struct stack_buffers b = carve(s);
    return half == 0 ? attention_half(layer, s, &b, x, residual, (int)first, partials, 1)
                     : mlp_half(layer, s, &b, x, residual, partials, 1);
}
