// A chat at the terminal through pyengine's C++ header: each line read is the user's
// turn, and the reply streams back as the engine makes it (the request's events, taken
// as a range; batch_threads.cpp takes them through a callback instead).
//
//   chat [--model M] [--max-tokens N] [--option NAME=VALUE]... [--system TEXT]
//
// Greedy, so that a run can be compared with LLM.chat's. An empty line or EOF ends it.
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "pyengine/pyengine.hpp"

int main(int argc, char** argv) {
  std::string model;
  std::map<std::string, std::string> options;
  std::vector<pyengine::Message> messages;
  pyengine_sampling_params sampling = pyengine_sampling_default_params();
  sampling.temperature = 0.0f;
  sampling.max_tokens = 128;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") {
      model = value;
    } else if (flag == "--max-tokens") {
      sampling.max_tokens = std::stoi(value);
    } else if (flag == "--system") {
      messages.push_back({"system", value});
    } else if (flag == "--option" && value.find('=') != std::string::npos) {
      options[value.substr(0, value.find('='))] = value.substr(value.find('=') + 1);
    } else {
      std::cerr << "unknown argument " << flag << "\n";
      return 2;
    }
  }
  try {
    pyengine::Engine engine(model, options);
    for (std::string line; std::cout << "> " << std::flush, std::getline(std::cin, line);) {
      if (line.empty()) break;
      messages.push_back({"user", line});
      std::string reply;
      pyengine::Request request = engine.submit(messages, sampling);
      for (const pyengine_event& event : request.events()) {
        if (event.status != PYENGINE_OK) throw pyengine::Error(event.status, event.error);
        std::cout.write(event.text, static_cast<std::streamsize>(event.text_len));
        std::cout.flush();
        reply.append(event.text, event.text_len);
      }
      std::cout << "\n";
      messages.push_back({"assistant", reply});
    }
  } catch (const pyengine::Error& error) {
    std::cerr << "\n" << error.what() << "\n";
    return 1;
  }
  return 0;
}
