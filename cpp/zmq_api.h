// The part of libzmq's C API the communicator uses.
//
// With libzmq's development headers installed (Debian's libzmq3-dev) this is just <zmq.h>. Without them (a
// user without root, a machine without Debian) amoe links the libzmq that pyzmq's wheel bundles (setup.py),
// which comes with no header: the declarations below are the stable libzmq 4.x ABI as its API reference
// documents it (the function signatures, zmq_msg_t's 64 opaque bytes, the option and event numbers).
// tests/test_zmq_api.py checks every number against pyzmq's constants and runs every declaration against the
// bundled library, so a drift fails the suite instead of corrupting a message.
#pragma once

#if __has_include(<zmq.h>) && !defined(AMOE_ZMQ_OWN_DECLARATIONS)
#include <zmq.h>
#else
#include <cstddef>

extern "C" {

// An opaque message: libzmq keeps its state in these 64 bytes, pointer-aligned.
typedef struct zmq_msg_t {
  alignas(void*) unsigned char opaque[64];
} zmq_msg_t;

// What zmq_poll watches: a socket (or, with socket null, a file descriptor) and the events of interest.
typedef struct zmq_pollitem_t {
  void* socket;
  int fd;
  short events;
  short revents;
} zmq_pollitem_t;

typedef void(zmq_free_fn)(void* data, void* hint);

void* zmq_ctx_new(void);
int zmq_ctx_term(void* context);
void* zmq_socket(void* context, int type);
int zmq_close(void* socket);
int zmq_setsockopt(void* socket, int option, const void* value, size_t length);
int zmq_getsockopt(void* socket, int option, void* value, size_t* length);
int zmq_bind(void* socket, const char* endpoint);
int zmq_connect(void* socket, const char* endpoint);
int zmq_socket_monitor(void* socket, const char* endpoint, int events);
int zmq_poll(zmq_pollitem_t* items, int count, long timeout);
int zmq_msg_init(zmq_msg_t* msg);
int zmq_msg_init_size(zmq_msg_t* msg, size_t size);
int zmq_msg_init_data(zmq_msg_t* msg, void* data, size_t size, zmq_free_fn* free_fn, void* hint);
int zmq_msg_send(zmq_msg_t* msg, void* socket, int flags);
int zmq_msg_recv(zmq_msg_t* msg, void* socket, int flags);
int zmq_msg_close(zmq_msg_t* msg);
void* zmq_msg_data(zmq_msg_t* msg);
size_t zmq_msg_size(const zmq_msg_t* msg);
int zmq_msg_more(const zmq_msg_t* msg);
int zmq_msg_get(const zmq_msg_t* msg, int property);
int zmq_errno(void);
const char* zmq_strerror(int errnum);

}  // extern "C"

// Socket types.
#define ZMQ_PAIR 0
#define ZMQ_PULL 7
#define ZMQ_PUSH 8
// Socket options.
#define ZMQ_LINGER 17
#define ZMQ_SNDHWM 23
#define ZMQ_RCVHWM 24
#define ZMQ_LAST_ENDPOINT 32
#define ZMQ_CURVE_SERVER 47
#define ZMQ_CURVE_PUBLICKEY 48
#define ZMQ_CURVE_SECRETKEY 49
#define ZMQ_CURVE_SERVERKEY 50
// Message property: the file descriptor of the connection a message came in on.
#define ZMQ_SRCFD 2
// Send / receive flags and poll events.
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1
// Monitor events.
#define ZMQ_EVENT_DISCONNECTED 512
#define ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL 2048
#define ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL 8192
#define ZMQ_EVENT_HANDSHAKE_FAILED_AUTH 16384
#endif
