"""Serving-engine integrations: :mod:`sketchcal.serving.vllm`, the vLLM plugin."""
