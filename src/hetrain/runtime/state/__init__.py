"""What training leaves on disk: checkpoints and exported weights.

- ``checkpoint``: atomic per-layer checkpoints with global names, loadable under any plan; damage detected.
- ``resume``: which checkpoint a run resumes from: the newest intact one, the same on every rank.
- ``stage_state``: one stage's share of a checkpoint, and its resume.
- ``export``: a checkpoint's weights as a Hugging Face directory or one safetensors file.
"""
