"""MARS Playground: `python app.py [--host 127.0.0.1] [--port 7860] [--model tiny-mars]`.

Without --model the page starts on tiny-mars at once while smollm2-mars (when its adapter is in
assets/) is built and loaded in the background; free text then moves to it, unless the user picked
a model. Every tab runs the picked model (the explorer's built-in tasks say when it was not trained on them).
"""
from app.launch import main  # the launcher lives in the package, so `mars-playground` runs the same code

if __name__ == "__main__":
    main()
