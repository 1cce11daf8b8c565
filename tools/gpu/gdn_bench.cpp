// Times ggml_gated_delta_net, the state update a Gated DeltaNet layer runs over every prompt row (RidgeFill's
// carry over filled rows included), alone, on the best backend ggml finds. It runs tokens in order inside one
// kernel, so its time can grow with the rows whatever the arithmetic: this measures how.
//   gdn_bench S_V H_K H_V TOKENS[,TOKENS...] [SEQS[,SEQS...]] [REPEATS]   -> one JSON object on stdout
// SEQS splits the rows into that many sequences of TOKENS/SEQS rows each (the same rows, more parallel work).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

// median milliseconds of one gated_delta_net call over n_tokens rows in n_seqs sequences
static double time_gdn(ggml_backend_t backend, int64_t s_v, int64_t h_k, int64_t h_v, int64_t n_tokens,
                       int64_t n_seqs, int repeats) {
    const int64_t per_seq = n_tokens / n_seqs;
    ggml_init_params ip = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_k, per_seq, n_seqs);
    ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_k, per_seq, n_seqs);
    ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, h_v, per_seq, n_seqs);
    ggml_tensor * g = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, h_v, per_seq, n_seqs);
    ggml_tensor * b = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, h_v, per_seq, n_seqs);
    ggml_tensor * s = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, s_v, s_v, h_v, n_seqs);
    ggml_tensor * out = ggml_gated_delta_net(ctx, q, k, v, g, b, s, 1);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    ggml_backend_buffer_t inputs = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!inputs || !ggml_gallocr_alloc_graph(galloc, gf)) {
        fprintf(stderr, "gdn_bench: cannot allocate %lld rows\n", (long long) n_tokens);
        exit(1);
    }
    std::mt19937 rng(42);
    // small keys and a gate below one keep the state bounded, as an L2-normed key and a decay do in the model
    fill_random(q, -0.1f, 0.1f, rng);
    fill_random(k, -0.1f, 0.1f, rng);
    fill_random(v, -1.0f, 1.0f, rng);
    fill_random(g, -0.5f, -0.01f, rng);
    fill_random(b, 0.0f, 1.0f, rng);
    fill_random(s, -0.01f, 0.01f, rng);

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
    ggml_gallocr_free(galloc);
    ggml_backend_buffer_free(inputs);
    ggml_free(ctx);
    return ms[ms.size()/2];
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
            const double ms = time_gdn(backend, s_v, h_k, h_v, n, m, repeats);
            printf("%s\n  {\"tokens\": %lld, \"seqs\": %lld, \"ms\": %.4f, \"us_per_token\": %.5f}", sep,
                   (long long) n, (long long) m, ms, 1000.0*ms/n);
            fflush(stdout);
            sep = ",";
        }
    }
    printf("\n]}\n");
    ggml_backend_free(backend);
    return 0;
}
