"""`foldline bench`: foldline's speed and memory beside the engines users would pick instead.

- timer: the warm-up, timing loop and peak RSS every engine runs, foldline and its peers alike;
- child: running an engine in a process of its own (one protocol for all);
- engines: foldline's own engines, the compiled runtime and the torch reference;
- peers: llama.cpp, ONNX Runtime GenAI and HF transformers on the same checkpoint;
- streams, chat: concurrent streams, and a multi-turn chat with the prompt cache;
- accuracy, prompts: each engine's logits against HF eager's on the shipped models' fixed prompts (`--accuracy`);
- rounds: every engine at every prompt length and thread count, in shuffled rounds;
- host: the host's load, and the refusal of a busy host;
- tables, plot, progress: what is printed, plotted (`--plot`) and shown while it works;
- modes: one function per kind of run, which the CLI (tools/bench_cmd.py) calls.
"""
