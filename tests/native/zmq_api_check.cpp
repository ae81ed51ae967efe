// Exercises every libzmq function and constant cpp/zmq_api.h declares, built with its own declarations
// (AMOE_ZMQ_OWN_DECLARATIONS) against the libzmq pyzmq's wheel bundles: the build a user without libzmq's headers
// gets. A wrong signature, struct size or number shows up here as a failed check or a crash, not as a corrupted
// message in the server. Prints "ok" and exits 0 when every check holds. Run by tests/test_zmq_api.py.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "zmq_api.h"

static int failures = 0;
#define CHECK(cond)                                                                                   \
  do {                                                                                                \
    if (!(cond)) {                                                                                    \
      std::printf("FAIL line %d: %s (%s)\n", __LINE__, #cond, zmq_strerror(zmq_errno()));             \
      failures++;                                                                                     \
    }                                                                                                 \
  } while (0)

static int freed = 0;
static void on_free(void*, void* hint) { freed += *static_cast<int*>(hint); }

int main() {
  static_assert(sizeof(zmq_msg_t) == 64, "libzmq's message is 64 opaque bytes");
  void* ctx = zmq_ctx_new();
  CHECK(ctx != nullptr);
  int hwm = 10, zero = 0, one = 1;

  void* pull = zmq_socket(ctx, ZMQ_PULL);
  CHECK(zmq_setsockopt(pull, ZMQ_RCVHWM, &hwm, sizeof hwm) == 0);
  CHECK(zmq_bind(pull, "tcp://127.0.0.1:*") == 0);
  char endpoint[256] = {0};
  size_t length = sizeof endpoint;
  CHECK(zmq_getsockopt(pull, ZMQ_LAST_ENDPOINT, endpoint, &length) == 0);
  CHECK(std::strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0 && length == std::strlen(endpoint) + 1);
  CHECK(zmq_socket_monitor(pull, "inproc://monitor", ZMQ_EVENT_DISCONNECTED) == 0);
  void* monitor = zmq_socket(ctx, ZMQ_PAIR);
  CHECK(zmq_connect(monitor, "inproc://monitor") == 0);

  void* push = zmq_socket(ctx, ZMQ_PUSH);
  CHECK(zmq_setsockopt(push, ZMQ_SNDHWM, &hwm, sizeof hwm) == 0);
  CHECK(zmq_connect(push, endpoint) == 0);

  // A two-part message: a copied header, then a payload handed over without a copy (freed through on_free).
  zmq_msg_t header;
  CHECK(zmq_msg_init_size(&header, 5) == 0);
  std::memcpy(zmq_msg_data(&header), "hello", 5);
  CHECK(zmq_msg_send(&header, push, ZMQ_SNDMORE) == 5);
  static unsigned char payload[100000];
  for (size_t i = 0; i < sizeof payload; i++) payload[i] = static_cast<unsigned char>(i * 7);
  int weight = 7;
  zmq_msg_t body;
  CHECK(zmq_msg_init_data(&body, payload, sizeof payload, on_free, &weight) == 0);
  CHECK(zmq_msg_send(&body, push, 0) == static_cast<int>(sizeof payload));

  zmq_pollitem_t item = {pull, 0, ZMQ_POLLIN, 0};
  CHECK(zmq_poll(&item, 1, 5000) == 1 && (item.revents & ZMQ_POLLIN));
  zmq_msg_t got;
  CHECK(zmq_msg_init(&got) == 0);
  CHECK(zmq_msg_recv(&got, pull, 0) == 5 && zmq_msg_size(&got) == 5);
  CHECK(std::memcmp(zmq_msg_data(&got), "hello", 5) == 0 && zmq_msg_more(&got) == 1);
  CHECK(zmq_msg_get(&got, ZMQ_SRCFD) > 0);  // the connection's file descriptor
  CHECK(zmq_msg_close(&got) == 0);
  zmq_msg_init(&got);
  CHECK(zmq_msg_recv(&got, pull, ZMQ_DONTWAIT) == static_cast<int>(sizeof payload));
  CHECK(zmq_msg_more(&got) == 0 && std::memcmp(zmq_msg_data(&got), payload, sizeof payload) == 0);
  zmq_msg_close(&got);
  zmq_msg_init(&got);
  CHECK(zmq_msg_recv(&got, pull, ZMQ_DONTWAIT) == -1 && zmq_errno() == EAGAIN);  // nothing more
  zmq_msg_close(&got);

  // The sender goes: the monitor reports the disconnect (a 6-byte frame: 16-bit event, 32-bit value).
  CHECK(zmq_setsockopt(push, ZMQ_LINGER, &zero, sizeof zero) == 0);
  CHECK(zmq_close(push) == 0);
  zmq_pollitem_t watch = {monitor, 0, ZMQ_POLLIN, 0};
  CHECK(zmq_poll(&watch, 1, 5000) == 1);
  zmq_msg_init(&got);
  CHECK(zmq_msg_recv(&got, monitor, 0) == 6);
  uint16_t event = 0;
  std::memcpy(&event, zmq_msg_data(&got), sizeof event);
  CHECK(event == ZMQ_EVENT_DISCONNECTED && zmq_msg_more(&got) == 1);
  zmq_msg_close(&got);
  zmq_msg_init(&got);
  CHECK(zmq_msg_recv(&got, monitor, 0) > 0);  // the endpoint
  zmq_msg_close(&got);

  // CURVE: a server takes its secret key, a client the server's and its own (32 raw bytes each).
  unsigned char key[32] = {1, 2, 3};
  void* server = zmq_socket(ctx, ZMQ_PAIR);
  CHECK(zmq_setsockopt(server, ZMQ_CURVE_SERVER, &one, sizeof one) == 0);
  CHECK(zmq_setsockopt(server, ZMQ_CURVE_SECRETKEY, key, sizeof key) == 0);
  void* client = zmq_socket(ctx, ZMQ_PAIR);
  CHECK(zmq_setsockopt(client, ZMQ_CURVE_SERVERKEY, key, sizeof key) == 0);
  CHECK(zmq_setsockopt(client, ZMQ_CURVE_PUBLICKEY, key, sizeof key) == 0);
  CHECK(zmq_setsockopt(client, ZMQ_CURVE_SECRETKEY, key, sizeof key) == 0);
  (void)ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;  // numbers checked against pyzmq's by the Python test
  (void)ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL;
  (void)ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

  for (void* s : {pull, monitor, server, client}) {
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(zmq_close(s) == 0);
  }
  CHECK(zmq_ctx_term(ctx) == 0);
  CHECK(freed == 7);  // the zero-copy payload was handed back exactly once
  if (failures == 0) std::printf("ok\n");
  return failures;
}
