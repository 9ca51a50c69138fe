"""MARS Playground: `python app.py [--host 127.0.0.1] [--port 7860] [--model tiny-mars]`."""
import argparse
import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no telemetry


def main(argv=None):
    parser = argparse.ArgumentParser(description="MARS Playground (Gradio)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--model", default="tiny-mars", help="model loaded at start-up (name, path or hub id)")
    parser.add_argument("--runs-dir", default=None, help="where Finetune runs live (default: ./runs)")
    args = parser.parse_args(argv)

    import gradio as gr
    from app import models, ui

    demo = ui.build_ui(args.model, runs_dir=args.runs_dir or ui.RUNS_DIR)
    builtin = [v for _, v in models.BUILTIN_MODELS]
    try:  # load (and warm up) the start-up model so the first race is quick and fair
        if args.model in builtin:
            models.get_model(models.resolve(args.model))
        else:
            models.get_model(models.resolve("", args.model))
    except Exception as exc:
        print(f"warning: could not preload {args.model!r}: {models.friendly_error(exc)}")
    demo.queue(default_concurrency_limit=1).launch(
        server_name=args.host, server_port=args.port, share=False, show_error=False, ssr_mode=False,
        max_file_size="20mb", theme=gr.themes.Soft(), css=ui.CSS, footer_links=[])


if __name__ == "__main__":
    main()
