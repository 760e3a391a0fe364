"""The Raincheck Gradio demo (`python -m demo.app`); see demo/README.md."""
