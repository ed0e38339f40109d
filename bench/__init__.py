"""`foldline bench`: foldline's speed and memory beside the engines users would pick instead.

- timer: the timing loop every engine runs, foldline and its peers alike;
- child: running an engine in a process of its own (one protocol for all);
- engines: foldline's own engines, the compiled runtime and the torch reference;
- peers: llama.cpp and HF transformers on the same checkpoint;
- streams, chat: concurrent streams, and a multi-turn chat with the prompt cache;
- tables: what is printed;
- modes: one function per kind of run, which the CLI (tools/bench_cmd.py) calls.
"""
