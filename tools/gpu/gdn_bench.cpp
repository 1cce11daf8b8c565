// Times ggml_gated_delta_net, the state update a Gated DeltaNet layer runs over every prompt row (RidgeFill's
// carry over filled rows included), alone, on the best backend ggml finds. It runs tokens in order inside one
// kernel, so its time can grow with the rows whatever the arithmetic: this measures how.
//   gdn_bench S_V H_K H_V TOKENS[,TOKENS...] [SEQS[,SEQS...]] [REPEATS]   -> one JSON object on stdout
// SEQS splits the rows into that many sequences of TOKENS/SEQS rows each (the same rows, more parallel work).
// Each cell times the op three times: as llama_decode builds it; asked for RidgeFill's blocked form (op param 1,
// which a backend without that kernel ignores), saying how far the blocked outputs and states are from the row
// walk's, relative to their largest magnitude; and blocked with the outputs unread (op param 2, RidgeFill's carry
// over filled rows), saying whether its states have the blocked form's bytes.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

static std::vector<int64_t> parse_list(const char * s) {
    std::vector<int64_t> out;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');) {
        out.push_back(std::stoll(item));
    }
    return out;
}

static void fill_random(ggml_tensor * t, float lo, float hi, std::mt19937 & rng) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> data(ggml_nelements(t));
    for (float & x : data) {
        x = dist(rng);
    }
    ggml_backend_tensor_set(t, data.data(), 0, ggml_nbytes(t));
}

// rows of unit length, as the models' L2-normed queries and keys
static void fill_unit_rows(ggml_tensor * t, std::mt19937 & rng) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> data(ggml_nelements(t));
    for (size_t r = 0; r < data.size(); r += t->ne[0]) {
        double norm = 0.0;
        for (int64_t i = 0; i < t->ne[0]; ++i) {
            data[r + i] = dist(rng);
            norm += (double) data[r + i] * data[r + i];
        }
        for (int64_t i = 0; i < t->ne[0]; ++i) {
            data[r + i] = (float) (data[r + i] / std::sqrt(norm));
        }
    }
    ggml_backend_tensor_set(t, data.data(), 0, ggml_nbytes(t));
}

struct gdn_cell {
    double ms_row_walk, ms_blocked, ms_states_only;
    double out_err, state_err; // largest difference over the largest magnitude
    bool   states_only_same;   // the states-only form's states have the blocked form's bytes
};

static double rel_err(const std::vector<float> & a, const std::vector<float> & b, size_t from, size_t to) {
    double diff = 0.0, mag = 0.0;
    for (size_t i = from; i < to; ++i) {
        diff = std::max(diff, (double) std::fabs(a[i] - b[i]));
        mag  = std::max(mag, (double) std::fabs(a[i]));
    }
    return mag > 0.0 ? diff / mag : diff;
}

static double median_ms(ggml_backend_t backend, ggml_cgraph * gf, int repeats) {
    ggml_backend_graph_compute(backend, gf); // warm-up
    ggml_backend_synchronize(backend);
    std::vector<double> ms;
    for (int r = 0; r < repeats; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size()/2];
}

// one gated_delta_net call over n_tokens rows in n_seqs sequences, as llama_decode builds it and blocked
static gdn_cell time_gdn(ggml_backend_t backend, int64_t s_v, int64_t h_k, int64_t h_v, int64_t n_tokens,
                         int64_t n_seqs, int repeats, bool unit_keys) {
    const int64_t per_seq = n_tokens / n_seqs;
    ggml_init_params ip = { 16*ggml_tensor_overhead() + 3*ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_k, per_seq, n_seqs);
    ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_k, per_seq, n_seqs);
    ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_v, per_seq, n_seqs);
    ggml_tensor * g = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, h_v, per_seq, n_seqs);
    ggml_tensor * b = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, h_v, per_seq, n_seqs);
    ggml_tensor * s = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, s_v, h_v, n_seqs);
    ggml_tensor * walk    = ggml_gated_delta_net(ctx, q, k, v, g, b, s, 1);
    ggml_tensor * blocked = ggml_gated_delta_net(ctx, q, k, v, g, b, s, 1);
    ggml_tensor * states  = ggml_gated_delta_net(ctx, q, k, v, g, b, s, 1);
    blocked->op_params[1] = 1; // RidgeFill's blocked form, where the backend has it
    states->op_params[1]  = 1;
    states->op_params[2]  = 1; // no node reads the outputs
    ggml_set_output(walk);
    ggml_set_output(blocked);
    ggml_set_output(states);
    ggml_cgraph * gf_walk = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf_walk, walk);
    ggml_cgraph * gf_blocked = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf_blocked, blocked);
    ggml_cgraph * gf_states = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf_states, states);

    ggml_backend_buffer_t inputs = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!inputs) {
        fprintf(stderr, "gdn_bench: cannot allocate %lld rows\n", (long long) n_tokens);
        exit(1);
    }
    std::mt19937 rng(42);
    if (unit_keys) { // the models' case: unit queries and keys, the delta rule's full step
        fill_unit_rows(q, rng);
        fill_unit_rows(k, rng);
    } else {         // small keys and a gate below one keep the state bounded
        fill_random(q, -0.1f, 0.1f, rng);
        fill_random(k, -0.1f, 0.1f, rng);
    }
    fill_random(v, -1.0f, 1.0f, rng);
    fill_random(g, -0.5f, -0.01f, rng);
    fill_random(b, 0.0f, 1.0f, rng);
    fill_random(s, -0.01f, 0.01f, rng);

    gdn_cell cell{};
    cell.ms_row_walk = median_ms(backend, gf_walk, repeats);
    cell.ms_blocked  = median_ms(backend, gf_blocked, repeats);
    cell.ms_states_only = median_ms(backend, gf_states, repeats);
    std::vector<float> a(ggml_nelements(walk)), c(ggml_nelements(blocked)), d(ggml_nelements(states));
    ggml_backend_tensor_get(walk, a.data(), 0, ggml_nbytes(walk));
    ggml_backend_tensor_get(blocked, c.data(), 0, ggml_nbytes(blocked));
    ggml_backend_tensor_get(states, d.data(), 0, ggml_nbytes(states));
    const size_t n_out = (size_t) (s_v * h_v * n_tokens);
    cell.out_err   = rel_err(a, c, 0, n_out);
    cell.state_err = rel_err(a, c, n_out, a.size());
    cell.states_only_same = std::equal(c.begin() + n_out, c.end(), d.begin() + n_out,
                                       [](float x, float y) { return std::memcmp(&x, &y, sizeof(float)) == 0; });
    ggml_backend_buffer_free(inputs);
    ggml_free(ctx);
    return cell;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s S_V H_K H_V TOKENS[,TOKENS...] [SEQS[,SEQS...]] [REPEATS]\n", argv[0]);
        return 2;
    }
    const int64_t s_v = std::atoll(argv[1]), h_k = std::atoll(argv[2]), h_v = std::atoll(argv[3]);
    const std::vector<int64_t> tokens = parse_list(argv[4]);
    const std::vector<int64_t> seqs = argc > 5 ? parse_list(argv[5]) : std::vector<int64_t>{ 1 };
    const int repeats = argc > 6 ? std::atoi(argv[6]) : 5;
    ggml_backend_load_all();
    ggml_backend_t backend = ggml_backend_init_best();
    if (!backend) {
        fprintf(stderr, "gdn_bench: no backend\n");
        return 1;
    }
    printf("{\"backend\": \"%s\", \"s_v\": %lld, \"h_k\": %lld, \"h_v\": %lld, \"repeats\": %d, \"cells\": [",
           ggml_backend_name(backend), (long long) s_v, (long long) h_k, (long long) h_v, repeats);
    const char * sep = "";
    for (int64_t n : tokens) {
        for (int64_t m : seqs) {
            if (n % m != 0) {
                continue;
            }
            for (bool unit_keys : { false, true }) {
                const gdn_cell c = time_gdn(backend, s_v, h_k, h_v, n, m, repeats, unit_keys);
                printf("%s\n  {\"tokens\": %lld, \"seqs\": %lld, \"unit_keys\": %s, \"ms\": %.4f, "
                       "\"us_per_token\": %.5f, \"blocked_ms\": %.4f, \"blocked_us_per_token\": %.5f, "
                       "\"blocked_out_err\": %.3g, \"blocked_state_err\": %.3g, \"states_only_ms\": %.4f, "
                       "\"states_only_us_per_token\": %.5f, \"states_only_same_states\": %s}", sep, (long long) n,
                       (long long) m, unit_keys ? "true" : "false", c.ms_row_walk, 1000.0*c.ms_row_walk/n,
                       c.ms_blocked, 1000.0*c.ms_blocked/n, c.out_err, c.state_err, c.ms_states_only,
                       1000.0*c.ms_states_only/n, c.states_only_same ? "true" : "false");
                fflush(stdout);
                sep = ",";
            }
        }
    }
    printf("\n]}\n");
    ggml_backend_free(backend);
    return 0;
}
