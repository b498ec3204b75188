"""The one room that knows ComfyUI: how its ops compute with their weights, which code its
classes carry, and what its ``VAE.decode`` does. Families and nodes ask these modules; nothing
here compares version strings (what a tree has is detected)."""
