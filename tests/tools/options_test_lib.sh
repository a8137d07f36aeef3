# Shared by the CPU tests of the bench programs' command lines (test_*_options.sh), sourced after they set
# `bench` (the program) and `name` (how messages call it): fail, refused (a refusal: exit status 2 and an
# expected text on stderr, before any CUDA call) and finish (the summary and the exit status).
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

refused() { # $1 expected text in stderr, then the arguments
  local expected="$1"
  shift
  local err rc
  err="$("$bench" "$@" 2>&1 >/dev/null)"
  rc=$?
  [ "$rc" -eq 2 ] || fail "$name $*: exit status $rc, expected 2"
  case "$err" in *"$expected"*) ;; *) fail "$name $*: stderr '$err' lacks '$expected'" ;; esac
}

finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures failure(s)" >&2
    exit 1
  fi
  echo "$name options: ok"
}
