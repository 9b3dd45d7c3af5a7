#pragma once
// The signals that end a run from outside (Ctrl-C's SIGINT, SIGTERM, SIGHUP, SIGQUIT), held back in the calling
// thread while an InterruptsHeld lives: one that arrives meanwhile waits, and is delivered - with its usual effect,
// the end of the process - when the last InterruptsHeld of the thread ends. A result file being replaced
// (replacing_file.h) holds them, so an interrupt never leaves its temporary behind; threads started while they are
// held keep them held for good (the CPU backend's workers: an interrupt then goes to the thread that runs the
// program, never to a worker that would end the process in the middle of a replacement).
#include <pthread.h>
#include <signal.h>

namespace kvs {

class InterruptsHeld {
 public:
  InterruptsHeld() {
    sigset_t interrupts;
    sigemptyset(&interrupts);
    for (const int signal : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&interrupts, signal);
    pthread_sigmask(SIG_BLOCK, &interrupts, &previous_);
  }
  ~InterruptsHeld() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }  // one that waited acts now
  InterruptsHeld(const InterruptsHeld&) = delete;
  InterruptsHeld& operator=(const InterruptsHeld&) = delete;

 private:
  sigset_t previous_;
};

}  // namespace kvs
