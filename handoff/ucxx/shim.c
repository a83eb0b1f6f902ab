//go:build cgo && ucx

#include "shim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void push(kvf_worker *w, const kvf_event *e)
{
	if (w->n == w->cap) {
		size_t cap = w->cap ? 2 * w->cap : 64;
		kvf_event *ev = realloc(w->ev, cap * sizeof *ev);
		if (ev == NULL) {
			w->overflow = 1;
			return;
		}
		w->ev = ev;
		w->cap = cap;
	}
	w->ev[w->n++] = *e;
}

void kvf_events(kvf_worker *w, kvf_event **evs, size_t *n)
{
	*evs = w->ev;
	*n = w->n;
	w->ev = NULL;
	w->n = w->cap = 0;
}

/* A request's end: user_data is the worker, the token travels in a
 * per-request slot (see kvf_param). */
typedef struct {
	kvf_worker *w;
	uint64_t token;
	uint8_t header[KVF_HEADER_MAX]; /* kvf_am_write's, which UCX 1.13 reads until the send ends */
} kvf_req_ctx;

static void done(void *request, ucs_status_t status, kvf_req_ctx *c)
{
	kvf_event e = {.kind = KVF_EV_DONE, .status = status, .token = c->token};
	push(c->w, &e);
	free(c);
	ucp_request_free(request);
}

static void send_cb(void *request, ucs_status_t status, void *user_data) { done(request, status, user_data); }

static void recv_am_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
	(void)length; /* posted for the message's exact length */
	done(request, status, user_data);
}

/* settle turns what an nbx call returned into the shim's convention,
 * freeing the callback's context when no callback will come. */
static ucs_status_t settle(ucs_status_ptr_t p, kvf_req_ctx *c)
{
	if (p == NULL) {
		free(c);
		return UCS_OK;
	}
	if (UCS_PTR_IS_ERR(p)) {
		free(c);
		return UCS_PTR_STATUS(p);
	}
	return UCS_INPROGRESS;
}

static kvf_req_ctx *req_ctx(kvf_worker *w, uint64_t token)
{
	kvf_req_ctx *c = malloc(sizeof *c);
	if (c != NULL) {
		c->w = w;
		c->token = token;
	}
	return c;
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_len, void *data, size_t len,
                          const ucp_am_recv_param_t *param)
{
	kvf_worker *w = arg;
	kvf_event e = {.kind = KVF_EV_AM, .len = len};
	if (header_len > KVF_HEADER_MAX) {
		return UCS_OK; /* not a kvfence sender: dropped */
	}
	memcpy(e.header, header, header_len);
	e.header_len = header_len;
	if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
		e.rndv = 1;
		e.data = data; /* fetched by kvf_am_recv, into the reader's buffer */
		push(w, &e);
		return UCS_INPROGRESS;
	}
	if (len > 0) {
		e.data = malloc(len);
		if (e.data == NULL) {
			w->overflow = 1;
			return UCS_OK;
		}
		memcpy(e.data, data, len);
	}
	push(w, &e);
	return UCS_OK;
}

/* An endpoint's failure names the endpoint: UCX may report one for an
 * endpoint after its close (the peer's transports reset it), so no state
 * of the endpoint's own is passed that its close could have freed. The
 * handle stays allocated while UCX can still report it, so it names no
 * other endpoint; Go ignores the ones it has closed. */
static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
	kvf_event e = {.kind = KVF_EV_EPERR, .status = status, .data = ep};
	push(arg, &e);
}

/* Whether UCX_TLS lets UCX use a transport that any of names (a NULL
 * terminated list) selects: unset, an exclusion list ("^...") that names
 * none of them, or a list that names one (or all). Settings for a
 * transport UCX does not open make it warn at every worker. */
static int tls_may_use(const char *const *names)
{
	const char *tls = getenv("UCX_TLS");
	if (tls == NULL || *tls == '\0') {
		return 1;
	}
	int named = 0;
	for (; *names != NULL; names++) {
		named |= strstr(tls, *names) != NULL;
	}
	return tls[0] == '^' ? !named : named || strstr(tls, "all") != NULL;
}

static const char *const tcp_names[] = {"tcp", NULL};
/* sm and shm select posix and sysv, the transports of UCX_MM_*. */
static const char *const mm_names[] = {"sm", "shm", "posix", "sysv", NULL};

ucs_status_t kvf_context_open(kvf_context **out)
{
	kvf_context *c = calloc(1, sizeof *c);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_config_t *config;
	ucs_status_t st = ucp_config_read(NULL, NULL, &config);
	if (st != UCS_OK) {
		free(c);
		return st;
	}
	/* UCX's TCP transport moves a put in segments of UCX_TCP_TX_SEG_SIZE
	 * (8K by default), each copied into a segment, sent, received into
	 * one and copied out (UCX 1.13 emulates puts over TCP with active
	 * messages), and acknowledged: 256K segments move the handoff's
	 * chunks at about 3x the rate for a quarter of the CPU (BenchmarkPut),
	 * 1M segments a whole handoff for 3-11 % less CPU again at the median
	 * (BenchmarkHandoff). The environment still decides: only where it
	 * sets neither size (their RX must not be below TX). */
	if (getenv("UCX_TCP_TX_SEG_SIZE") == NULL && getenv("UCX_TCP_RX_SEG_SIZE") == NULL && tls_may_use(tcp_names)) {
		(void)ucp_config_modify(config, "TX_SEG_SIZE", KVF_TCP_SEG_SIZE); /* only TCP has these */
		(void)ucp_config_modify(config, "RX_SEG_SIZE", KVF_TCP_SEG_SIZE);
	}
	/* Shared memory (posix, sysv) moves an emulated put, and every
	 * message, in elements of UCX_MM_SEG_SIZE (8K by default), each
	 * copied into the receiver's queue, out of it, and acknowledged: 32K
	 * elements take a quarter of that per byte. Not 64K or more: UCX 1.13
	 * keeps an element's length in 16 bits, and a longer one arrives cut
	 * (the handoff's checksums refuse it). */
	if (getenv("UCX_MM_SEG_SIZE") == NULL && tls_may_use(mm_names)) {
		(void)ucp_config_modify(config, "MM_SEG_SIZE", KVF_MM_SEG_SIZE);
	}
	/* mt_workers_shared: each connection's worker runs on the goroutines
	 * of its own connection, several at once, and they share the
	 * context's memory registrations. */
	ucp_params_t params = {
	    .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME,
	    .features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
	    .mt_workers_shared = 1,
	    .name = "kvfence",
	};
	st = ucp_init(&params, config, &c->ctx);
	ucp_config_release(config);
	if (st != UCS_OK) {
		free(c);
		return st;
	}
	ucp_context_attr_t cattr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
	if (ucp_context_query(c->ctx, &cattr) == UCS_OK) {
		c->mem_types = cattr.memory_types;
	}
	*out = c;
	return UCS_OK;
}

void kvf_context_close(kvf_context *c)
{
	ucp_cleanup(c->ctx);
	free(c);
}

ucs_status_t kvf_worker_open(kvf_context *c, kvf_worker **out)
{
	kvf_worker *w = calloc(1, sizeof *w);
	if (w == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_worker_params_t wparams = {
	    .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
	    .thread_mode = UCS_THREAD_MODE_SERIALIZED,
	};
	ucs_status_t st = ucp_worker_create(c->ctx, &wparams, &w->worker);
	if (st != UCS_OK) {
		free(w);
		return st;
	}
	ucp_am_handler_param_t am = {
	    .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
	    .id = KVF_AM_ID,
	    .cb = am_cb,
	    .arg = w,
	};
	if ((st = ucp_worker_set_am_recv_handler(w->worker, &am)) != UCS_OK ||
	    (st = ucp_worker_get_efd(w->worker, &w->efd)) != UCS_OK) {
		ucp_worker_destroy(w->worker);
		free(w);
		return st;
	}
	*out = w;
	return UCS_OK;
}

void kvf_worker_close(kvf_worker *w)
{
	/* The requests still in flight are cancelled on the way: their
	 * callbacks queue events, freed below with the rest. */
	ucp_worker_destroy(w->worker);
	for (size_t i = 0; i < w->n; i++) {
		if (w->ev[i].kind == KVF_EV_AM && !w->ev[i].rndv) {
			free(w->ev[i].data);
		}
	}
	free(w->ev);
	free(w);
}

ucs_status_t kvf_connect(kvf_worker *w, const void *addr, ucp_ep_h *out)
{
	/* Error handling mode NONE, with a handler: UCX 1.13 builds an endpoint
	 * in mode PEER only of transports that detect a peer's failure
	 * themselves, which leaves out shared memory (posix, sysv) and, for
	 * an endpoint created from a worker address, every transport's remote
	 * memory access. Failures the transports see still reach the handler
	 * (their requests complete with the error); a peer that goes quiet is
	 * the liveness connection's to detect (conn.watch). An endpoint in
	 * this mode cannot be forced closed (UCX refuses): a connection that
	 * fails destroys its worker instead (kvf_worker_close). */
	ucp_ep_params_t params = {
	    .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
	                  UCP_EP_PARAM_FIELD_ERR_HANDLER,
	    .address = addr,
	    .err_mode = UCP_ERR_HANDLING_MODE_NONE,
	    .err_handler = {.cb = ep_err_cb, .arg = w},
	};
	return ucp_ep_create(w->worker, &params, out);
}

ucs_status_t kvf_address(kvf_worker *w, void **addr, size_t *len)
{
	ucp_address_t *a;
	ucs_status_t st = ucp_worker_get_address(w->worker, &a, len);
	if (st != UCS_OK) {
		return st;
	}
	*addr = malloc(*len);
	if (*addr == NULL) {
		ucp_worker_release_address(w->worker, a);
		return UCS_ERR_NO_MEMORY;
	}
	memcpy(*addr, a, *len);
	ucp_worker_release_address(w->worker, a);
	return UCS_OK;
}

static ucp_request_param_t send_param(kvf_req_ctx *c)
{
	ucp_request_param_t p = {
	    .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
	    .cb = {.send = send_cb},
	    .user_data = c,
	};
	return p;
}

ucs_status_t kvf_am_send(kvf_worker *w, ucp_ep_h ep, const void *header, size_t header_len, const ucp_dt_iov_t *iov,
                         size_t iovcnt, uint64_t token)
{
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_request_param_t p = send_param(c);
	/* Eager only: a rendezvous send waits for the peer to fetch it, and UCX
	 * 1.13 never ends the wait of one whose peer is gone on an endpoint in
	 * error mode NONE (see kvf_connect); ucxx bounds what is in flight
	 * with credits instead (conn.go). */
	p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = UCP_AM_SEND_FLAG_EAGER;
	if (iovcnt == 0) { /* a message of its header alone */
		return settle(ucp_am_send_nbx(ep, KVF_AM_ID, header, header_len, NULL, 0, &p), c);
	}
	p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
	p.datatype = UCP_DATATYPE_IOV;
	return settle(ucp_am_send_nbx(ep, KVF_AM_ID, header, header_len, iov, iovcnt, &p), c);
}

ucs_status_t kvf_am_write(kvf_worker *w, ucp_ep_h ep, const void *header, size_t header_len, const void *buf, size_t len,
                          uint64_t token)
{
	if (header_len > KVF_HEADER_MAX) {
		return UCS_ERR_INVALID_PARAM;
	}
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	memcpy(c->header, header, header_len);
	ucp_request_param_t p = send_param(c);
	/* By rendezvous: the bytes move once, from buf straight into the
	 * receiver's memory, by the transport's zero-copy operations (over
	 * TCP, one send and one receive in the kernel), not through UCX's
	 * buffers as an emulated put's do. Should the peer go quiet, the wait
	 * is ended by the connection's failure, which destroys the worker. */
	p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = UCP_AM_SEND_FLAG_RNDV;
	return settle(ucp_am_send_nbx(ep, KVF_AM_ID, c->header, header_len, buf, len, &p), c);
}

ucs_status_t kvf_am_recv(kvf_worker *w, void *data_desc, void *buf, size_t len, uint64_t token)
{
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_request_param_t p = {
	    .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
	    .cb = {.recv_am = recv_am_cb},
	    .user_data = c,
	};
	return settle(ucp_am_recv_data_nbx(w->worker, data_desc, buf, len, &p), c);
}

ucs_status_t kvf_put(kvf_worker *w, ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey,
                     uint64_t token)
{
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_request_param_t p = send_param(c);
	return settle(ucp_put_nbx(ep, buf, len, raddr, rkey, &p), c);
}

ucs_status_t kvf_flush(kvf_worker *w, ucp_ep_h ep, uint64_t token)
{
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_request_param_t p = send_param(c);
	return settle(ucp_ep_flush_nbx(ep, &p), c);
}

ucs_status_t kvf_ep_close(kvf_worker *w, ucp_ep_h ep, uint64_t token)
{
	kvf_req_ctx *c = req_ctx(w, token);
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ucp_request_param_t p = send_param(c);
	return settle(ucp_ep_close_nbx(ep, &p), c);
}

ucs_status_t kvf_mem_map(kvf_context *c, void *addr, size_t len, ucp_mem_h *memh, void **rkey, size_t *rkey_len)
{
	ucp_mem_map_params_t params = {
	    .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_PROT,
	    .address = addr,
	    .length = len,
	    .prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_WRITE,
	};
	ucs_status_t st = ucp_mem_map(c->ctx, &params, memh);
	if (st != UCS_OK) {
		return st;
	}
	if ((st = ucp_rkey_pack(c->ctx, *memh, rkey, rkey_len)) != UCS_OK) {
		ucp_mem_unmap(c->ctx, *memh);
	}
	return st;
}

char *kvf_ep_info(ucp_ep_h ep)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	if (f == NULL) {
		return NULL;
	}
	ucp_ep_print_info(ep, f);
	fclose(f);
	return buf;
}
