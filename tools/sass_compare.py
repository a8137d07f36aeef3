#!/usr/bin/env python3
"""Compares the SASS of two builds function by function: which kernels a change left byte-for-byte the same.

    python3 tools/sass_compare.py OLD NEW [--rename FROM=TO ...] [--show N] [--cuobjdump PATH]

OLD and NEW are object files, shared libraries or cubins (dumped with `cuobjdump -sass`), or text files that
already hold `cuobjdump -sass` output (anything whose first bytes are not an ELF header). Each function's
instructions are compared after removing what does not depend on the code itself: the instruction addresses
(/*0a30*/), the encodings (/* 0x... */) and the hash in anonymous-namespace names
(_GLOBAL__N__<hash>_<n>_<file>_<hash>, which changes with the source file's contents). Functions are matched by
architecture and mangled name; --rename FROM=TO rewrites NEW's names first (e.g. a template parameter the change
added: --rename ELi1EEEvNS0=EEEvNS0). Prints one line per function (SAME, DIFF, OLD-ONLY or NEW-ONLY, with the
instruction counts) and, with --show N, the first N changed lines of each DIFF.

Exit status: 0 when every function is in both and the same, 1 when any differs or is in one only, 2 on bad
input. Used to back "the same SASS" claims of changes that only move or rename code (docs/*.md).
"""

import argparse
import difflib
import re
import shutil
import subprocess
import sys

ADDRESS = re.compile(r"/\*[0-9a-fA-F]{4,}\*/")
ENCODING = re.compile(r"/\* 0x[0-9a-fA-F]+ \*/")
ANONYMOUS = re.compile(r"\d*_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")
FUNCTION = re.compile(r"Function : (\S+)")
ARCH = re.compile(r"^\s*code for (sm_\w+)")


def fail(message):
    print("sass_compare: " + message, file=sys.stderr)
    sys.exit(2)


def sass_text(path, cuobjdump):
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as error:
        fail("cannot read %s: %s" % (path, error.strerror))
    if head != b"\x7fELF":
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    tool = cuobjdump or shutil.which("cuobjdump")
    if tool is None:
        fail("%s is an ELF file and no cuobjdump was found (PATH or --cuobjdump); or pass cuobjdump -sass text"
             % path)
    result = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if result.returncode != 0:
        fail("cuobjdump -sass %s failed: %s" % (path, result.stderr.strip()))
    return result.stdout


def functions(text, renames=()):
    """{(arch, name): [normalised instruction lines]} of one cuobjdump -sass listing."""
    out = {}
    arch, current = "", None
    for line in text.splitlines():
        match = ARCH.match(line)
        if match:
            arch, current = match.group(1), None
            continue
        match = FUNCTION.search(line)
        if match:
            name = match.group(1)
            for old, new in renames:
                name = name.replace(old, new)
            current = (arch, name)
            if current in out:
                fail("function %s appears twice for %s" % (name, arch or "one architecture"))
            out[current] = []
            continue
        if current is None or not ADDRESS.search(line):
            continue  # only instructions: not the header flags, separators or relocation notes
        line = ANONYMOUS.sub("ANON", ENCODING.sub("", ADDRESS.sub("", line))).strip()
        if line:
            out[current].append(line)
    return out


def main():
    parser = argparse.ArgumentParser(description="Compare two builds' SASS function by function.")
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rename", action="append", default=[], metavar="FROM=TO",
                        help="rewrite FROM to TO in NEW's function names before matching (repeatable)")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print N diff lines of each DIFF")
    parser.add_argument("--cuobjdump", help="the cuobjdump to run on ELF inputs (default: the one on PATH)")
    args = parser.parse_args()
    renames = []
    for item in args.rename:
        if "=" not in item or item.startswith("="):
            fail("--rename %r: expected FROM=TO with a non-empty FROM" % item)
        renames.append(tuple(item.split("=", 1)))
    if args.show < 0:
        fail("--show %d: must be >= 0" % args.show)
    old = functions(sass_text(args.old, args.cuobjdump))
    new = functions(sass_text(args.new, args.cuobjdump), renames)
    if not old and not new:
        fail("no functions in either input (not cuobjdump -sass output?)")
    differ = False
    for key in sorted(set(old) | set(new)):
        arch, name = key
        label = "%s %s" % (arch, name) if arch else name
        if key not in new:
            print("OLD-ONLY %s (%d instr)" % (label, len(old[key])))
            differ = True
        elif key not in old:
            print("NEW-ONLY %s (%d instr)" % (label, len(new[key])))
            differ = True
        elif old[key] == new[key]:
            print("SAME %s (%d instr)" % (label, len(old[key])))
        else:
            print("DIFF %s (%d -> %d instr)" % (label, len(old[key]), len(new[key])))
            differ = True
            if args.show:
                diff = difflib.unified_diff(old[key], new[key], lineterm="", n=0)
                lines = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
                for line in lines[:args.show]:
                    print("    " + line)
    return 1 if differ else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader stopped early (| head): not an error of the comparison
        sys.stderr.close()
        sys.exit(0)
