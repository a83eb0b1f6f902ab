//go:build cgo && ucx

/*
 * shim.h: the few C helpers handoff/ucxx needs around UCX's ucp API.
 *
 * UCX reports what happened (a request completed, an active message
 * arrived, a connection was requested, an endpoint failed) through
 * callbacks, which run inside ucp_worker_progress and the calls that post
 * operations. The callbacks here only append an event to the worker's
 * queue; Go drains the queue after each call, so no Go code runs on a UCX
 * callback and no Go pointer is ever stored in UCX. Every function is
 * called with the Go side's worker lock held (UCS_THREAD_MODE_SERIALIZED).
 */
#ifndef KVF_UCXX_SHIM_H
#define KVF_UCXX_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

/* Event kinds. */
enum {
	KVF_EV_DONE = 1,  /* a request completed: token, status */
	KVF_EV_AM = 2,    /* an active message: header, data or rndv desc */
	KVF_EV_EPERR = 3, /* an endpoint failed: data (the endpoint), status */
};

#define KVF_AM_ID 0x4b56 /* "KV" */
/* UCX's TCP segments and shared-memory elements where the environment
 * sizes none (kvf_context_open). */
#define KVF_TCP_SEG_SIZE "1M"
#define KVF_MM_SEG_SIZE "32K"
#define KVF_HEADER_MAX 32

typedef struct {
	int kind;
	int status;      /* ucs_status_t */
	uint64_t token;  /* KVF_EV_DONE */
	void *data;      /* KVF_EV_AM: a malloc'd copy, or the rndv descriptor; KVF_EV_EPERR: the endpoint */
	size_t len;      /* KVF_EV_AM: the data's length */
	int rndv;        /* KVF_EV_AM: data is a rendezvous descriptor, to release */
	uint8_t header[KVF_HEADER_MAX];
	size_t header_len;
} kvf_event;

/* A UCX context: the configuration, the transports and the memory
 * registrations, shared by the workers made from it. */
typedef struct {
	ucp_context_h ctx;
	uint64_t mem_types; /* the memory types the context supports */
} kvf_context;

/* A worker, which serves one connection at a time. */
typedef struct {
	ucp_worker_h worker;
	int efd;
	kvf_event *ev; /* the queue */
	size_t n, cap;
	int overflow; /* an event could not be queued (no memory) */
} kvf_worker;

/* kvf_context_open creates a context (features AM, RMA, wakeup) whose
 * workers may run on different threads at once. It reads UCX's
 * environment (UCX_TLS, UCX_NET_DEVICES, ...). */
ucs_status_t kvf_context_open(kvf_context **out);
void kvf_context_close(kvf_context *c);

/* kvf_worker_open creates a worker of the context. kvf_worker_close
 * destroys it, and with it its endpoints and every operation they still
 * had: UCX reads and writes no memory for them afterwards. */
ucs_status_t kvf_worker_open(kvf_context *c, kvf_worker **out);
void kvf_worker_close(kvf_worker *w);

/* kvf_events moves the queue to the caller: *n events at *evs, which the
 * caller frees (free) once it has handled them. */
void kvf_events(kvf_worker *w, kvf_event **evs, size_t *n);

/* kvf_address copies the worker's address into malloc'd memory (*addr,
 * *len) for the caller to free: what a peer's kvf_connect takes. */
ucs_status_t kvf_address(kvf_worker *w, void **addr, size_t *len);

/* kvf_connect creates an endpoint to the worker whose address is addr;
 * its failures come as KVF_EV_EPERR events that name it (data). */
ucs_status_t kvf_connect(kvf_worker *w, const void *addr, ucp_ep_h *out);

/* The operations below return UCS_OK when the operation completed at
 * once (no event follows), UCS_INPROGRESS when a KVF_EV_DONE event with
 * token will report its end, or an error. */
ucs_status_t kvf_am_send(kvf_worker *w, ucp_ep_h ep, const void *header, size_t header_len, const ucp_dt_iov_t *iov,
                         size_t iovcnt, uint64_t token);
/* kvf_am_write sends len bytes at buf as an active message by rendezvous:
 * the receiver fetches them into memory of its choosing (kvf_am_recv), or
 * releases them; the header is copied, to live until the send ends. */
ucs_status_t kvf_am_write(kvf_worker *w, ucp_ep_h ep, const void *header, size_t header_len, const void *buf, size_t len,
                          uint64_t token);
/* kvf_am_recv receives the rendezvous message data_desc names (a
 * KVF_EV_AM event's data) into len bytes at buf, its exact length. */
ucs_status_t kvf_am_recv(kvf_worker *w, void *data_desc, void *buf, size_t len, uint64_t token);
ucs_status_t kvf_put(kvf_worker *w, ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey,
                     uint64_t token);
ucs_status_t kvf_flush(kvf_worker *w, ucp_ep_h ep, uint64_t token);
/* kvf_ep_close closes the endpoint once its operations have completed
 * (a flush, then the disconnect). UCX 1.13 has no forced close for an
 * endpoint in error mode NONE (it refuses one as an invalid parameter):
 * an endpoint that cannot be flushed ends with its worker. */
ucs_status_t kvf_ep_close(kvf_worker *w, ucp_ep_h ep, uint64_t token);

ucs_status_t kvf_mem_map(kvf_context *c, void *addr, size_t len, ucp_mem_h *memh, void **rkey, size_t *rkey_len);

/* kvf_ep_info describes the endpoint's lanes (ucp_ep_print_info), in
 * memory the caller frees. */
char *kvf_ep_info(ucp_ep_h ep);

#endif
