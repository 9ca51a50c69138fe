"""The app's launcher: `python app.py`, `mars-playground` (installed console script), `python -m app`.

Without --model the page starts on tiny-mars at once while smollm2-mars (when its adapter is in the
assets) is built and loaded in the background; free text then moves to it, unless the user picked
a model. Every tab runs the picked model (the explorer's built-in tasks say when it was not trained on them).
"""
import argparse
import os
import threading
import time

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no telemetry


def main(argv=None):
    parser = argparse.ArgumentParser(description="MARS Playground (Gradio)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--model", default=None,
                        help="model loaded at start-up and kept (name, path or hub id); default: start on tiny-mars "
                             "and move free text to smollm2-mars once it is ready")
    parser.add_argument("--runs-dir", default=None, help="where Finetune runs live (default: ./runs)")
    parser.add_argument("--allow-hub", action="store_true",
                        help="let the model field download hub ids (off by default: the app makes no network calls)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for decoding (default 1: on a small shared CPU a second thread "
                             "made tiny-model forwards up to 20x slower and the race unstable)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: use 1 or more")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported: every thread's pool
    if not args.allow_hub:  # a hub id typed into the page then fails with a readable message, downloads nothing
        os.environ["HF_HUB_OFFLINE"] = "1"

    from app import models
    builtin = models.builtin_names()
    start_model = args.model or models.DEFAULT_MODEL
    t0 = time.perf_counter()
    preloaded = threading.Event()

    def preload():  # torch, transformers and the start-up model, once the page answers (a race waits for them)
        try:
            import torch
            torch.set_num_threads(args.threads)
            named = start_model in builtin or start_model == models.SMOLLM2_MARS   # a name, not a path
            models.get_model(models.resolve(start_model) if named else models.resolve("", start_model))
            print(f"[app] model {start_model!r} ready ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:
            print(f"[app] warning: could not preload {start_model!r}: {models.friendly_error(exc)}", flush=True)
        finally:
            preloaded.set()

    # smollm2-mars: its one-time build (cached afterwards; docs/experiments/app-timing.md, "Load times") and load
    # run after the start-up model's, in
    # their own thread. The page polls models.prepare_status() and never waits for it.
    if models.start_background_prepare(wait_for=preloaded, log=lambda msg: print(f"[app] {msg}", flush=True)):
        print(f"[app] {models.SMOLLM2_MARS} loads in the background (the page says how far it is)", flush=True)

    import gradio as gr
    from app import ui
    demo = ui.build_ui(args.model, runs_dir=args.runs_dir or ui.RUNS_DIR)
    demo.queue(default_concurrency_limit=1).launch(
        server_name=args.host, server_port=args.port, share=False, show_error=False, ssr_mode=False,
        max_file_size="20mb", theme=gr.themes.Soft(), css=ui.CSS, head=ui.HEAD, footer_links=[],
        prevent_thread_lock=True)
    # The page answers now, before torch and transformers are imported (neither is needed to build it): on a
    # 2-core CPU they cost seconds of CPU (docs/experiments/app-timing.md, "How soon `python app.py` gives a usable
    # page"), and importing them beside gradio's import and the page's build (one
    # GIL) delayed the page by as much. They load now, then the start-up model, then smollm2-mars; a race asked
    # for meanwhile says it is loading and waits for them. Loading after launch also keeps gradio's start-up
    # check (that localhost answers) from being starved by the w8a8 calibration and compile.
    threading.Thread(target=preload, daemon=True, name="preload").start()
    demo.block_thread()

