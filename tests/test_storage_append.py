"""append_lines is all or nothing: a short write on a full disk leaves no torn line."""

from __future__ import annotations

import errno
import os

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core import storage
from llmport_agent.core.storage import append_lines, read_json_lines


class AppendLinesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = os.path.abspath(self.mktemp())
        append_lines(self.path, [b'{"id":"a"}\n'])

    def test_short_write_then_enospc_is_cut_off_and_raised(self) -> None:
        """The part that fit is truncated away and ENOSPC raised; the next append is whole."""
        calls = []

        def full_disk(fd: int, data: memoryview) -> int:
            calls.append(len(data))
            if len(calls) == 1:
                return os.write(fd, data[:5])  # what fit in the last page
            raise OSError(errno.ENOSPC, "No space left on device")

        with self.assertRaises(OSError) as e:
            append_lines(self.path, [b'{"id":"b","state":"received"}\n'], write=full_disk)
        self.assertEqual(e.exception.errno, errno.ENOSPC)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b'{"id":"a"}\n')
        append_lines(self.path, [b'{"id":"c"}\n'])
        self.assertEqual(read_json_lines(self.path), ([{"id": "a"}, {"id": "c"}], 0))

    def test_short_writes_are_continued(self) -> None:
        """A write that returns short without an error is continued until all is written."""
        def dribble(fd: int, data: memoryview) -> int:
            return os.write(fd, data[:3])

        append_lines(self.path, [b'{"id":"b"}\n', b'{"id":"c"}\n'], write=dribble)
        self.assertEqual(read_json_lines(self.path), ([{"id": "a"}, {"id": "b"}, {"id": "c"}], 0))

    def test_zero_byte_write_is_an_error(self) -> None:
        """A write that makes no progress raises instead of looping."""
        with self.assertRaises(OSError):
            append_lines(self.path, [b'{"id":"b"}\n'], write=lambda fd, data: 0)
        self.assertEqual(read_json_lines(self.path), ([{"id": "a"}], 0))


class NewFileTests(SynchronousTestCase):
    """An append to an empty (perhaps new) file makes its name durable too."""

    def test_the_directory_is_synced_when_the_file_was_empty(self) -> None:
        synced: list[str] = []
        real = storage.fsync_dir
        self.patch(storage, "fsync_dir", lambda d: (synced.append(d), real(d)))
        path = os.path.abspath(self.mktemp())
        append_lines(path, [b'{"id":"a"}\n'])
        self.assertEqual(synced, [os.path.dirname(path)])
        append_lines(path, [b'{"id":"b"}\n'])
        self.assertEqual(synced, [os.path.dirname(path)])  # not again: the name is there
        self.assertEqual(read_json_lines(path), ([{"id": "a"}, {"id": "b"}], 0))
