"""The vLLM wing: everything of batchjson that reads or changes vLLM's internals, by subject, each file with the
vLLM files and names it read ("Read on") and versions.py's one table of which vLLM each patch was read on.

- versions.py: the table (patch -> versions read, and why a patch is off on a version read), `installs_once`, and
  what the run's report (`notice`) and `batchjson check` (`check_lines`) say of the patches off here.
- patches.py: the patches as one set (the plugin's `install`, the runner's `install_in_runner`).
- scheduler.py: pass 2 without drafts, the idle drafter, the fast loop guard.
- fills.py: the grammar's masks in one call a step (BatchFills). ahead.py, ahead_hooks.py: the grammars' work beside
  the forward's launch (GrammarAhead). masks.py: the masks scattered on the GPU with drafts (the V1 runner).
- drafts.py: the schema drafts in the scheduler (custom_class: 0.26, 0.32); schema_speculator/: the same drafts as a
  speculator registered with vLLM's register_speculative_method (Model Runner V2: 0.34).
- kv.py: the KV cache's size, reported. timers.py: the step profiler's timers.
- processes.py: the engine processes' watcher, shutdown and plugin flag, and VllmEngine's reads past vLLM's API.

Importing the package or any of its modules imports no vLLM (schema_speculator's config.py and speculator.py
excepted: vLLM imports them itself, in its processes).
"""
