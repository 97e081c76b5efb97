# Shared by the benchmark scripts (sourced, not run).

# The `interlock train` flags of a mode: e2e, N (N-way FURTHEST), Nsum.
mode_flags() {
  case $1 in
    e2e) echo "--mode e2e" ;;
    *sum) echo "--mode interlock --n ${1%sum} --rule sum" ;;
    *) echo "--mode interlock --n $1 --rule furthest" ;;
  esac
}

# Microseconds some task waited for a CPU (Linux PSI), or empty.
cpu_stall_us() {
  if [[ -r /proc/pressure/cpu ]]; then
    sed -n 's/^some .*total=\([0-9]*\).*/\1/p' /proc/pressure/cpu
  fi
}

now_us() { date +%s%6N; }
