"""
What every layer uses: configuration, state and storage, link-safe file operations, thread
pools, back-off, logging setup, bounded HTTP bodies, text cleaning.
"""
