"""Llama 3.2 Vision: images in, text out (docs/vision.md)."""
