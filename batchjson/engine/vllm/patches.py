"""The wing's patches as one set: installed in each vLLM process of a run by the plugin (engine/plugin.py, `install`),
and in the runner by VllmEngine (`install_in_runner`); and the grammar fills' line for the run's report."""

from __future__ import annotations

from batchjson.engine.vllm import ahead, ahead_hooks, drafts, fills, kv, masks, scheduler
from batchjson.engine.vllm.versions import unread_here


def install() -> None:
    """The patches, in this process (the plugin calls it in each vLLM process of a run)."""
    scheduler.install_no_draft()
    scheduler.install_fast_loop_guard()
    drafts.install_scheduler_drafts()
    scheduler.install_idle_drafter()
    masks.install_mask_scatter()
    kv.install_kv_size_report()
    install_fills()


def install_fills() -> None:
    """The grammar fills' patches as the run asks for them: batchjson's batch fills unless grammar_fills = "vllm",
    with GrammarAhead unless turned off."""
    if fills.fills_wanted():
        fills.install_batch_fills()
        if ahead.ahead_wanted():
            ahead_hooks.install_grammar_ahead()


def install_in_runner() -> None:
    """The patches the runner's own process needs: the scheduler's (whether pass 2 can go without drafts is
    decided here, and they serve an engine core in this process). The model runner's only where the engine core runs
    in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): elsewhere the plugin patches it in the engine process, and
    importing the GPU model runner here would only add its import to the start (bare vLLM's runner never imports it)."""
    scheduler.install_no_draft()
    scheduler.install_fast_loop_guard()
    drafts.install_scheduler_drafts()
    import vllm.envs

    if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        scheduler.install_idle_drafter()
        masks.install_mask_scatter()
        kv.install_kv_size_report()
        install_fills()


def grammar_fills(setting: str) -> str:
    """The grammar fill path an engine started with `setting` ([model] grammar_fills) runs, for the run's report:
    "batch (...)", or "vllm (why)". Reads this vLLM and xgrammar; installs nothing."""
    if setting == "vllm":
        return 'vllm ([model] grammar_fills = "vllm")'
    why = fills.batch_fills_unready()
    if why:
        return f"vllm ({why})"
    threads = fills.fill_threads()
    beside = "" if unread_here("grammar_ahead") or not ahead.ahead_wanted() else "; beside the forward's launch"
    return f"batch (xgrammar's batch matcher, {threads} thread{'s' if threads > 1 else ''}{beside})"
