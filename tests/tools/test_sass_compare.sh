#!/usr/bin/env bash
# CPU test of tools/sass_compare.py on synthetic cuobjdump -sass listings (no cuobjdump needed): addresses,
# encodings and anonymous-namespace hashes ignored; a changed instruction, a function in one listing only and
# the same name on two architectures told apart; --rename; --show; exit statuses; malformed input refused.
#
#   tests/tools/test_sass_compare.sh <repository root>
set -uo pipefail
bench="$1/tools/sass_compare.py"
name=sass_compare
source "$1/tests/tools/options_test_lib.sh"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
out=""
compare() { # $1 expected exit status, then the arguments; the output goes to $out
  local expected="$1" status
  shift
  out="$("$bench" "$@")"
  status=$?
  [ "$status" -eq "$expected" ] || fail "$name $*: exit status $status, expected $expected"
}
expect() { # $1 expected line of the last output (exact)
  # A here-string, not a pipe: grep -q stops at its first match, and under pipefail the writer's SIGPIPE would
  # fail a line that is there.
  grep -xF -- "$1" <<<"$out" >/dev/null || fail "no line '$1' in:
$out"
}

listing() { # $1 hash of the anonymous namespace, $2 the second instruction of k2, $3 k3's name
  cat <<LISTING

Fatbin elf code:
================
arch = sm_90

	code for sm_90
		Function : _Z2k1v
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   CALL.REL.NOINC \`(_ZN8smcgraph6detail${1}_12_sample_cu_0f1e2d3c4helperEv) ;  /* 0x0000000000007944 */
        /*0020*/                   EXIT ;                                  /* 0x000000000000794d */
		..........

		Function : _Z2k2v
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   $2 ;                                  /* 0x0000000000007992 */
        /*0020*/                   EXIT ;                                  /* 0x000000000000794d */

		Function : $3
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */

	code for sm_100
		Function : _Z2k1v
        /*0000*/                   NOP ;                                   /* 0x0000000000007918 */
LISTING
}
listing "_GLOBAL__N__aaaaaaaa" "MEMBAR.ALL.GPU" "_Z2k3ILi1EEvv" > "$dir/old.sass"
listing "_GLOBAL__N__bbbbbbbb" "MEMBAR.ALL.GPU" "_Z2k3ILi1EEvv" | sed 's#/\*0010\*/#/*0a10*/#' > "$dir/same.sass"
listing "_GLOBAL__N__bbbbbbbb" "NOP" "_Z2k3ILi1ELi2EEvv" > "$dir/new.sass"

compare 0 "$dir/old.sass" "$dir/same.sass"
expect "SAME sm_90 _Z2k1v (3 instr)"
expect "SAME sm_90 _Z2k2v (3 instr)"
expect "SAME sm_100 _Z2k1v (1 instr)"

compare 1 "$dir/old.sass" "$dir/new.sass" --show 4
expect "SAME sm_90 _Z2k1v (3 instr)"
expect "DIFF sm_90 _Z2k2v (3 -> 3 instr)"
expect "    -MEMBAR.ALL.GPU ;"
expect "    +NOP ;"
expect "OLD-ONLY sm_90 _Z2k3ILi1EEvv (1 instr)"
expect "NEW-ONLY sm_90 _Z2k3ILi1ELi2EEvv (1 instr)"

compare 1 "$dir/old.sass" "$dir/new.sass" --rename ELi2EEvv=EEvv # k2 still differs
expect "SAME sm_90 _Z2k3ILi1EEvv (1 instr)"

echo "not a listing" > "$dir/empty.sass"
refused "no functions in either input" "$dir/empty.sass" "$dir/empty.sass"
refused "cannot read" "$dir/old.sass" "$dir/missing.sass"
refused "expected FROM=TO" "$dir/old.sass" "$dir/new.sass" --rename nothing
refused "must be >= 0" "$dir/old.sass" "$dir/new.sass" --show -1
finish
