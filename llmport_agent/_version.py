"""
Provides llmport_agent version information.
"""

# This file is auto-generated! Do not edit!
# Use `python -m incremental.update llmport_agent` to change this file.

from incremental import Version

__version__ = Version("llmport_agent", 0, 1, 0)
__all__ = ["__version__"]
