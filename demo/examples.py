"""The example files the page offers: glyph grids with benchmark questions (a bundled model), or generated
pictures and a short clip (any other model). Written into a folder given by the caller, when the app is built."""

import os

GLYPH_EXAMPLE_DIALOGUES = (0, 1)  # dev-split dialogues: a list question first, then a fact question first


def make_glyph_examples(folder: str) -> list[tuple[str, str, str | None]]:
    """``(label, question, file or None)``: dev-split glyph grids with their benchmark questions, each
    grid's first question (with the file) followed by its first follow-up (without)."""
    from raincheck_hf.quality.glyphs import benchmark_split

    dialogues = benchmark_split("dev", limit=max(GLYPH_EXAMPLE_DIALOGUES) + 1)
    samples = []
    for number, index in enumerate(GLYPH_EXAMPLE_DIALOGUES, 1):
        d = dialogues[index]
        path = os.path.join(folder, f"glyphs-{d.uid}.png")
        d.image().save(path)
        first = "list question" if d.turns[0].kind == "list" else "one fact"
        samples.append((f"Grid {number} ({d.grid}×{d.grid}): {first}", d.turns[0].question, path))
        samples.append((f"Grid {number}: follow-up", d.turns[1].question, None))
    return samples


def make_examples(folder: str) -> dict:
    """Example files drawn with `raincheck_hf.tiny`'s drawers: two images and a short H.264 video."""
    import numpy as np

    from raincheck_hf.tiny import draw_test_image, draw_test_video

    paths = {"blocks": os.path.join(folder, "blocks.png"), "tall": os.path.join(folder, "tall.png")}
    draw_test_image(384, 288, seed=0).save(paths["blocks"])
    draw_test_image(224, 320, seed=3).save(paths["tall"])
    try:
        import av
    except ImportError:  # no video example (and no video decoding) without PyAV: pip install av
        return paths
    paths["video"] = os.path.join(folder, "clip.mp4")
    frames = draw_test_video(num_frames=8, width=256, height=192, seed=4).permute(0, 2, 3, 1).numpy()
    with av.open(paths["video"], mode="w") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")))
        container.mux(stream.encode())
    return paths



def page_samples(glyph_examples: bool, folder: str) -> list[tuple[str, str, str | None]]:
    """The page's examples, ``(label, question, file or None)``, their files written into ``folder``: glyph grids
    with benchmark questions for a bundled glyph model, otherwise generated pictures and a clip (without PyAV,
    no clip)."""
    if glyph_examples:
        return make_glyph_examples(folder)
    examples = make_examples(folder)
    samples = [("Image: first question", "What is in this image?", examples["blocks"]),
               ("Image: follow-up", "Which colour is the block in the top-left corner?", None),
               ("Video: first question", "What happens in the video?", examples.get("video")),
               ("Video: follow-up", "What changes between the first and the last frame?", None),
               ("Tall image: one sentence", "Describe the picture in one sentence.", examples["tall"])]
    return [s for s in samples if not s[0].startswith("Video") or "video" in examples]
