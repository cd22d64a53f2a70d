// A batch job without a server: prompts from stdin, one per line, submitted from many
// threads at once into one engine, which runs them in one continuous batch. Each
// completion is printed on the line of its prompt, in order.
//
//   batch_threads [--threads N] [--model M] [--max-tokens N] [--option NAME=VALUE]...
//                 [--ids] [--token-prompts] [--stream] [--ignore-eos] [--rounds R]
//                 [--prompts FILE [--step]] < prompts.txt
//
// --ids prints token ids rather than text; --token-prompts reads each line as token ids;
// --stream takes each request's tokens through a callback rather than waiting for its
// end; --rounds splits the prompts into R batches run one after another. The time from
// each batch's first submission to its last token goes to stderr as JSON. --prompts
// reads them from FILE instead; with --step each round waits for a line on stdin and
// says "round SECONDS" on stderr when done (bench/c_api.py runs rounds in turn with
// the Python API's that way).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pyengine/pyengine.hpp"

namespace {

struct Job {
  std::string text;
  std::vector<std::int32_t> tokens;  // (--token-prompts)
  pyengine::Output output;
};

struct Settings {
  int threads = 8;
  bool ids = false;
  bool token_prompts = false;
  bool stream = false;
  int rounds = 1;
  std::string prompts;  // (a file; stdin where empty)
  bool step = false;
  pyengine_sampling_params sampling = pyengine_sampling_default_params();
};

// Streams a request's tokens through its callback into `job`; true once it has ended.
class Streamed {
 public:
  bool on_event(const pyengine_event& event, Job& job) {
    job.output.tokens.insert(job.output.tokens.end(), event.tokens, event.tokens + event.n_tokens);
    job.output.text.append(event.text, event.text_len);
    if (event.request_finished) {
      std::lock_guard<std::mutex> lock(mutex_);
      job.output.finish_reason = event.finish_reason;
      ended_ = true;
      done_.notify_all();
    }
    return true;
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return ended_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  bool ended_ = false;
};

// One thread's share of jobs [begin, end): it submits them all, then collects each
// one's output.
void run_share(pyengine::Engine& engine, std::vector<Job>& jobs, const Settings& settings,
               std::size_t begin, std::size_t end) {
  std::vector<pyengine::Request> requests;
  std::vector<Streamed> streams(jobs.size());
  const auto step = static_cast<std::size_t>(settings.threads);
  for (std::size_t i = begin; i < end; i += step) {
    Job& job = jobs[i];
    pyengine_request_params params = pyengine_request_default_params();
    params.sampling = settings.sampling;
    if (settings.token_prompts) {
      params.prompt_tokens = job.tokens.data();
      params.n_prompt_tokens = job.tokens.size();
    } else {
      params.prompt = job.text.c_str();
    }
    pyengine::Request::Callback callback;
    if (settings.stream)
      callback = [&stream = streams[i], &job](const pyengine_event& e) {
        return stream.on_event(e, job);
      };
    requests.push_back(engine.submit(params, callback));
  }
  std::size_t k = 0;
  for (std::size_t i = begin; i < end; i += step, ++k) {
    if (settings.stream) {
      streams[i].wait();
    } else {
      requests[k].wait();
      jobs[i].output = requests[k].output();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  settings.sampling.temperature = 0.0f;
  settings.sampling.max_tokens = 32;
  std::string model;
  std::map<std::string, std::string> options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--ids") { settings.ids = true; continue; }
    if (flag == "--token-prompts") { settings.token_prompts = true; continue; }
    if (flag == "--stream") { settings.stream = true; continue; }
    if (flag == "--ignore-eos") { settings.sampling.ignore_eos = true; continue; }
    if (flag == "--step") { settings.step = true; continue; }
    if (i + 1 >= argc) {
      std::cerr << flag << " needs a value\n";
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--threads") {
      settings.threads = std::stoi(value);
    } else if (flag == "--prompts") {
      settings.prompts = value;
    } else if (flag == "--rounds") {
      settings.rounds = std::stoi(value);
    } else if (flag == "--model") {
      model = value;
    } else if (flag == "--max-tokens") {
      settings.sampling.max_tokens = std::stoi(value);
    } else if (flag == "--option" && value.find('=') != std::string::npos) {
      options[value.substr(0, value.find('='))] = value.substr(value.find('=') + 1);
    } else {
      std::cerr << "unknown argument " << flag << "\n";
      return 2;
    }
  }
  if (settings.threads < 1 || settings.rounds < 1) {
    std::cerr << "--threads and --rounds take a positive count\n";
    return 2;
  }
  std::vector<Job> jobs;
  std::ifstream file(settings.prompts);
  if (!settings.prompts.empty() && !file) {
    std::cerr << "cannot read " << settings.prompts << "\n";
    return 2;
  }
  std::istream& input = settings.prompts.empty() ? std::cin : file;
  for (std::string line; std::getline(input, line);) {
    Job job;
    job.text = line;
    std::istringstream ids(line);
    for (std::int32_t id; settings.token_prompts && ids >> id;) job.tokens.push_back(id);
    jobs.push_back(std::move(job));
  }
  try {
    pyengine::Engine engine(model, options);
    std::string round_seconds;
    const std::size_t per_round = jobs.size() / static_cast<std::size_t>(settings.rounds);
    for (int round = 0; round < settings.rounds; ++round) {
      std::string go;
      if (settings.step && !std::getline(std::cin, go)) break;
      const std::size_t begin = per_round * static_cast<std::size_t>(round);
      const std::size_t end = round + 1 == settings.rounds ? jobs.size() : begin + per_round;
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> threads;
      for (std::size_t t = 0; t < static_cast<std::size_t>(settings.threads); ++t)
        threads.emplace_back(run_share, std::ref(engine), std::ref(jobs), std::cref(settings),
                             begin + t, end);
      for (std::thread& thread : threads) thread.join();
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      round_seconds += (round ? ", " : "") + std::to_string(took.count());
      if (settings.step) std::cerr << "round " << took.count() << std::endl;
    }
    std::size_t generated = 0;
    for (const Job& job : jobs) {
      generated += job.output.tokens.size();
      if (settings.ids) {
        for (std::size_t i = 0; i < job.output.tokens.size(); ++i)
          std::cout << (i ? " " : "") << job.output.tokens[i];
        std::cout << "\n";
      } else {
        std::cout << job.output.text << "\n";
      }
    }
    std::fprintf(stderr, "{\"requests\": %zu, \"output_tokens\": %zu, \"round_seconds\": [%s]}\n",
                 jobs.size(), generated, round_seconds.c_str());
  } catch (const pyengine::Error& error) {
    std::cerr << error.what() << "\n";
    return 1;
  }
  return 0;
}
