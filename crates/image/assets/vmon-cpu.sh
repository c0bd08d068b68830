# vmon: OpenBLAS kernels that the emulated CPU can run. Under TCG the guest's CPU is `qemu64`
# (AMD family 15 without SSSE3): OpenBLAS takes it for an Opteron and runs 3DNow! code TCG lacks
# (numpy's `dot` dies of SIGILL); its SSE3 kernels (Prescott) are right for that CPU, and a CPU
# with SSSE3 (KVM's models) keeps OpenBLAS's own choice. envd's init decides it once per boot
# from /proc/cpuinfo into /run/vmon/cpu.sh (a restored snapshot keeps both as that boot saw
# them); without that file the flags are read here.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if [ -r /run/vmon/cpu.sh ]; then
    . /run/vmon/cpu.sh
  else
    while IFS= read -r vmon_l; do
      case "$vmon_l" in
        flags*)
          case " $vmon_l " in
            *" ssse3 "*) ;;
            *) export OPENBLAS_CORETYPE=Prescott ;;
          esac
          break ;;
      esac
    done < /proc/cpuinfo
    unset vmon_l
  fi
fi
