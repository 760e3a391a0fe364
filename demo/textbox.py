"""The chat's textbox: Gradio's multimodal textbox, with every file left for the server to judge.

Imported when the app is built (it needs Gradio). Defining a component class makes Gradio write a type stub
beside its module (``textbox.pyi``: this module with its event listeners typed, for editors); git ignores it.
"""

import gradio as gr


class ChatTextbox(gr.MultimodalTextbox):
    """The file picker offers images and videos; the server reads every file itself, so that a
    wrong one gets an explanation in the chat rather than a bare "invalid file type" toast."""

    def get_block_name(self) -> str:
        return "multimodaltextbox"

    def preprocess(self, payload):
        if payload is None:
            return None
        return {"text": payload.text, "files": [f.path for f in payload.files]}
