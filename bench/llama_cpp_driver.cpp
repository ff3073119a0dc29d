// The llama.cpp system's driver (bench/llama_cpp.py builds it against the llama.cpp vendored in
// the llama-cpp-python sdist and runs it): loads a GGUF once, then answers requests on stdin, one
// a line, "TOKENS ID ID ...": the prompt's token ids prefilled in one llama_decode, then TOKENS - 1
// decode steps of one token each, greedy (the first highest logit, as torch's argmax), the KV
// cache cleared before each request. It answers one JSON line on stdout:
//   {"first_s": s, "latencies_s": [...], "tokens": [...], "cpu_s": s}
// first_s: the prefill and the first pick; latencies_s: each decode step (llama_decode of the
// previous token and the pick of the next), timed one by one; tokens: every token picked, the
// first included; cpu_s: the process's CPU seconds over the request.
//
//   expertcache-llama-driver MODEL.gguf THREADS N_CTX [mapped]
//
// With "mapped" the weights are used where the GGUF is memory-mapped (no repacked copies in
// anonymous memory): held to less memory than the model, llama.cpp then pages its experts in from
// the file as the routers pick them, which is what it does for a user without the RAM to hold them.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static double cpu_seconds() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_utime.tv_sec + usage.ru_utime.tv_usec * 1e-6 + usage.ru_stime.tv_sec +
           usage.ru_stime.tv_usec * 1e-6;
}

static void quiet_log(ggml_log_level level, const char* text, void*) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

static int pick(llama_context* ctx, int n_vocab) {
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0;
    for (int i = 1; i < n_vocab; ++i) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char** argv) {
    const bool mapped = argc == 5 && std::string(argv[4]) == "mapped";
    if (argc != 4 && !mapped) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS N_CTX [mapped]\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const int n_ctx = std::atoi(argv[3]);
    if (std::getenv("EXPERTCACHE_LLAMA_VERBOSE") == nullptr) {
        llama_log_set(quiet_log, nullptr);
    }
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.progress_callback = [](float, void*) { return true; };  // no progress dots
    if (mapped) {
        mparams.load_mode = LLAMA_LOAD_MODE_MMAP;  // pages of the file, reclaimable under a limit
        mparams.use_extra_bufts = false;           // no repacked copy of the weights
    }
    llama_model* model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        std::fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx;
    cparams.n_batch = n_ctx;
    cparams.n_ubatch = n_ctx;
    cparams.n_seq_max = 1;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.no_perf = true;
    llama_context* ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        std::fprintf(stderr, "llama.cpp could not create a context for %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::printf("{\"ready\": true, \"n_vocab\": %d, \"system_info\": \"%s\"}\n", n_vocab,
                llama_print_system_info());
    std::fflush(stdout);

    using clock = std::chrono::steady_clock;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        int tokens = 0;
        in >> tokens;
        std::vector<llama_token> prompt;
        for (llama_token t; in >> t;) {
            prompt.push_back(t);
        }
        if (tokens < 1 || prompt.empty() || static_cast<int>(prompt.size()) + tokens > n_ctx) {
            std::fprintf(stderr, "bad request: %s\n", line.c_str());
            return 1;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        const double cpu0 = cpu_seconds();
        std::vector<int> picked;
        std::vector<double> latencies;
        auto started = clock::now();
        if (llama_decode(ctx, llama_batch_get_one(prompt.data(), static_cast<int32_t>(prompt.size()))) != 0) {
            std::fprintf(stderr, "llama_decode failed on the prompt\n");
            return 1;
        }
        llama_token token = pick(ctx, n_vocab);
        const double first = std::chrono::duration<double>(clock::now() - started).count();
        picked.push_back(token);
        for (int i = 1; i < tokens; ++i) {
            started = clock::now();
            if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) {
                std::fprintf(stderr, "llama_decode failed at token %d\n", i);
                return 1;
            }
            token = pick(ctx, n_vocab);
            latencies.push_back(std::chrono::duration<double>(clock::now() - started).count());
            picked.push_back(token);
        }
        const double cpu = cpu_seconds() - cpu0;
        std::ostringstream out;
        out.precision(9);
        out << "{\"first_s\": " << first << ", \"latencies_s\": [";
        for (size_t i = 0; i < latencies.size(); ++i) {
            out << (i ? ", " : "") << latencies[i];
        }
        out << "], \"tokens\": [";
        for (size_t i = 0; i < picked.size(); ++i) {
            out << (i ? ", " : "") << picked[i];
        }
        out << "], \"cpu_s\": " << cpu << "}";
        std::cout << out.str() << std::endl;
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
