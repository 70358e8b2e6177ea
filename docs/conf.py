"""Sphinx configuration of llmport-agent's documentation (built by `tox -e docs`, warnings are errors)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the agent's own tree, for the generated references

project = "llmport-agent"
author = "llmport-agent contributors"
copyright = "llmport-agent contributors"
extensions = ["myst_parser", "llmport_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_split"]
myst_heading_anchors = 3
html_theme = "alabaster"
html_static_path: list[str] = []
suppress_warnings: list[str] = []
