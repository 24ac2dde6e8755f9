// Linked into every kernel .so so that it needs nothing newer than glibc 2.28 (the wheel's
// manylinux_2_28 tag), even when built on a newer system.
//
// Why: libstdc++ is linked statically (no GLIBCXX requirement at all), and the static CUDA
// runtime comes with it; the linker binds their unversioned references to the build machine's
// default symbol versions, e.g. pthread_once@GLIBC_2.34 (libpthread merged into libc) or
// arc4random@GLIBC_2.36. Each function below is defined here, hidden, so those references bind
// to it instead; it jumps to the x86-64 baseline version of the same symbol (GLIBC_2.2.5 unless
// noted), which every glibc since 2.2.5 exports (from libpthread/libdl/librt before 2.34, which
// the link lists as needed). Symbols with no old version get a small equivalent.
//
// NOTE: x86-64 only, like the cpu target; a symbol missing here shows up as a too-new version
// in tests/kernel_cache/test_platform_tag.py.
#if defined(__x86_64__) && defined(__linux__)
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

// A tail jump keeps every argument register untouched, so one trampoline fits any signature.
#define FT_PIN(sym, ver)                                                               \
  __asm__(".symver ft_glibc_" #sym ", " #sym "@" ver "\n"                             \
          ".globl " #sym "\n.hidden " #sym "\n.type " #sym ", @function\n" #sym ":\n"   \
          "  jmp ft_glibc_" #sym "@PLT\n.size " #sym ", .-" #sym "\n");
#define FT_PIN_BASE(sym) FT_PIN(sym, "GLIBC_2.2.5")

FT_PIN_BASE(pthread_create)
FT_PIN_BASE(pthread_detach)
FT_PIN_BASE(pthread_join)
FT_PIN_BASE(pthread_kill)
FT_PIN_BASE(pthread_once)
FT_PIN_BASE(pthread_key_create)
FT_PIN_BASE(__pthread_key_create)
FT_PIN_BASE(pthread_key_delete)
FT_PIN_BASE(pthread_getspecific)
FT_PIN_BASE(pthread_setspecific)
FT_PIN_BASE(pthread_mutex_trylock)
FT_PIN_BASE(pthread_mutexattr_init)
FT_PIN_BASE(pthread_mutexattr_destroy)
FT_PIN_BASE(pthread_mutexattr_settype)
FT_PIN_BASE(pthread_mutexattr_setpshared)
FT_PIN_BASE(pthread_condattr_setpshared)
FT_PIN_BASE(pthread_rwlock_init)
FT_PIN_BASE(pthread_rwlock_destroy)
FT_PIN_BASE(pthread_rwlock_rdlock)
FT_PIN_BASE(pthread_rwlock_wrlock)
FT_PIN_BASE(pthread_rwlock_tryrdlock)
FT_PIN_BASE(pthread_rwlock_trywrlock)
FT_PIN_BASE(pthread_rwlock_timedrdlock)
FT_PIN_BASE(pthread_rwlock_timedwrlock)
FT_PIN_BASE(pthread_rwlock_unlock)
FT_PIN_BASE(pthread_rwlockattr_init)
FT_PIN_BASE(pthread_rwlockattr_destroy)
FT_PIN_BASE(pthread_rwlockattr_setpshared)
FT_PIN_BASE(pthread_spin_init)
FT_PIN_BASE(pthread_spin_destroy)
FT_PIN_BASE(pthread_spin_lock)
FT_PIN_BASE(pthread_spin_trylock)
FT_PIN_BASE(pthread_spin_unlock)
FT_PIN_BASE(sem_init)
FT_PIN_BASE(sem_destroy)
FT_PIN_BASE(sem_post)
FT_PIN_BASE(sem_wait)
FT_PIN_BASE(sem_trywait)
FT_PIN_BASE(sem_timedwait)
FT_PIN_BASE(shm_open)
FT_PIN_BASE(shm_unlink)
FT_PIN_BASE(dlopen)
FT_PIN_BASE(dlclose)
FT_PIN_BASE(dlsym)
FT_PIN_BASE(dlvsym)
FT_PIN_BASE(dlerror)
FT_PIN(dlmopen, "GLIBC_2.3.4")

// glibc >= 2.33 exports fstat64; before, <sys/stat.h> called __fxstat64 (version 1 = kernel).
extern "C" int ft_glibc___fxstat64(int, int, struct stat64*);
__asm__(".symver ft_glibc___fxstat64, __fxstat64@GLIBC_2.2.5");
extern "C" __attribute__((visibility("hidden"))) int fstat64(int fd, struct stat64* buf) {
  return ft_glibc___fxstat64(1, fd, buf);
}

// glibc >= 2.32: libstdc++ skips atomic reference counts while this is nonzero. Zero ("maybe
// threaded") is always correct, only a little slower.
extern "C" __attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

// glibc >= 2.36: std::random_device's default source. getentropy is glibc 2.25.
extern "C" __attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t value = 0;
  while (getentropy(&value, sizeof(value)) != 0) {
  }
  return value;
}
#endif
