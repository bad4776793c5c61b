/* The model router's verdicts (route/route.c), for the combined plugin that calls it. */
#ifndef MESHFN_ROUTE_H
#define MESHFN_ROUTE_H

#define ROUTE_PASS 0    /* not a request the router routes: carry on */
#define ROUTE_WAIT 1    /* it needs the (rest of the) body first */
#define ROUTE_DONE 2    /* routed: the routing header is set and the route cache cleared */
#define ROUTE_REPLIED 3 /* refused with a local reply */

#endif
